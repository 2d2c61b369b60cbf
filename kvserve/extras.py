"""Optional dependencies (the extras of ``pyproject.toml``): imported when a feature that needs one starts, or an
ImportError that says how to install it."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def require_ray(feature: str) -> ModuleType:
    """Ray, for ``feature`` (a flag, named in the error when Ray is missing)."""
    return _require("ray", "Ray", "ray", feature)


def check_ray_installed(feature: str) -> None:
    """The ImportError ``require_ray`` raises, without importing Ray (seconds): for a configuration's checks."""
    if importlib.util.find_spec("ray") is None:
        raise ImportError(_missing("Ray", "ray", feature))


def require_matplotlib(feature: str) -> ModuleType:
    """matplotlib, for ``feature`` (a flag, named in the error when matplotlib is missing)."""
    return _require("matplotlib", "matplotlib", "bench", feature)


def _require(module: str, name: str, extra: str, feature: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(_missing(name, extra, feature)) from None


def _missing(name: str, extra: str, feature: str) -> str:
    return f"{feature} needs {name}: pip install 'kvserve[{extra}]'"
