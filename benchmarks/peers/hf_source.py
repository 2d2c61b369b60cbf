"""``from_pretrained`` arguments for a kvserve model string, shared by the peer scripts that run in kvserve's env."""

from __future__ import annotations

from typing import Any

from kvserve.model.sources import resolve_model


def pretrained_args(model: str) -> tuple[str, dict[str, Any]]:
    """(directory, kwargs) for transformers' ``from_pretrained``: a GGUF file is named through ``gguf_file``."""
    location = resolve_model(model)
    if location.kind == "gguf":
        return str(location.path.parent), {"gguf_file": location.path.name}
    return str(location.path), {}
