"""resolve_model: local directories and GGUF files, packaged names, the Hub (offline), in that order."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants

from kvserve.model import packaged
from kvserve.model.base import CheckpointError
from kvserve.model.sources import ModelLocation, ModelNotFoundError, resolve_model


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty kvserve cache and Hub cache, the Hub offline, and a working directory of our own."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "kvserve-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)


def make_hf_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_hf_directory(tmp_path: Path) -> None:
    directory = make_hf_dir(tmp_path / "model")
    (directory / "extra.gguf").write_bytes(b"GGUF")  # config.json wins over a stray GGUF
    assert resolve_model(str(directory)) == ModelLocation("hf_dir", directory, str(directory))


def test_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    assert resolve_model(str(path)) == ModelLocation("gguf", path, str(path))


def test_directory_with_one_gguf(tmp_path: Path) -> None:
    (tmp_path / "ggufs").mkdir()
    (tmp_path / "ggufs" / "only.gguf").write_bytes(b"GGUF")
    location = resolve_model("ggufs")
    assert (location.kind, location.path, location.name) == ("gguf", Path("ggufs/only.gguf"), "ggufs")


def test_directory_with_several_ggufs_names_them(tmp_path: Path) -> None:
    (tmp_path / "ggufs").mkdir()
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (tmp_path / "ggufs" / name).write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="several GGUF files.*a.Q4_0.gguf, a.Q8_0.gguf"):
        resolve_model("ggufs")


def test_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty has no config.json .* and no .gguf file"):
        resolve_model("empty")


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="weights.bin: a model file must be a .gguf file"):
        resolve_model("weights.bin")


def test_cached_packaged_model(tmp_path: Path) -> None:
    cached = packaged.cached_path("smollm2-135m-instruct")
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert resolve_model("smollm2-135m-instruct") == ModelLocation("gguf", cached, "smollm2-135m-instruct")
    assert resolve_model("SmolLM2-135M-Instruct").path == cached


def test_packaged_model_is_pulled_when_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pulled: list[str] = []

    def fake_pull(name: str) -> Path:
        pulled.append(name)
        return tmp_path / "pulled.gguf"

    monkeypatch.setattr(packaged, "pull", fake_pull)
    assert resolve_model("gemma-3-270m") == ModelLocation("gguf", tmp_path / "pulled.gguf", "gemma-3-270m")
    assert pulled == ["gemma-3-270m"]


def test_packaged_model_without_auto_pull() -> None:
    with pytest.raises(ModelNotFoundError, match="not in the cache.*kvserve pull gemma-3-270m"):
        resolve_model("gemma-3-270m", auto_pull=False)


def test_a_local_directory_shadows_a_packaged_name(tmp_path: Path) -> None:
    directory = make_hf_dir(tmp_path / "gemma-3-270m")
    assert resolve_model("gemma-3-270m") == ModelLocation("hf_dir", Path("gemma-3-270m"), "gemma-3-270m")
    assert directory.is_dir()


def test_unknown_name_lists_the_packaged_models() -> None:
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("no such model")
    message = str(error.value)
    assert "'no such model' is not a local path" in message
    assert "smollm2-135m-instruct, gemma-3-270m" in message


def test_hub_id_while_offline_fails_fast_and_says_so() -> None:
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("some-org/some-model")
    assert time.perf_counter() - start < 5
    message = str(error.value)
    assert "'some-org/some-model'" in message
    assert "appears to be offline" in message
    assert "local path" in message and "smollm2-135m-instruct, gemma-3-270m" in message


def test_hub_id_already_in_the_hub_cache_resolves_offline(tmp_path: Path) -> None:
    repo = tmp_path / "hub-cache" / "models--some-org--some-model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = make_hf_dir(repo / "snapshots" / commit)
    assert resolve_model("some-org/some-model") == ModelLocation("hf_dir", snapshot, "some-org/some-model")
