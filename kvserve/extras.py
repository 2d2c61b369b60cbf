"""Optional dependencies (the extras of ``pyproject.toml``): imported when a feature that needs one starts, or an
ImportError that says how to install it."""

from __future__ import annotations

from types import ModuleType


def require_ray(feature: str) -> ModuleType:
    """Ray, for ``feature`` (a flag, named in the error when Ray is missing)."""
    try:
        import ray
    except ImportError:
        raise ImportError(f"{feature} needs Ray: pip install 'kvserve[ray]'") from None
    return ray
