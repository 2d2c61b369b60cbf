"""LoRA adapters over HTTP (--enable-lora --lora-modules NAME=PATH), as vLLM's server serves them: a request's
``model`` naming an adapter runs with it (transformers' tokens with the adapter merged), the served name runs the
base model, an unknown name is a 404 naming it, /v1/models lists the adapters with the base model as parent; a bad
adapter stops the start-up naming it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from kvserve.cli_serve import lora_modules
from kvserve.engine_args import EngineArgs
from kvserve.lora_request import LoRARequest
from kvserve.model.lora_checkpoint import make_lora_adapter
from kvserve.pooling_params import PoolingParams
from kvserve.server.app import build_app
from kvserve.server.launch import load_engine
from kvserve.server.state import ServerSettings, ServerState
from tests.conftest import hf_greedy
from tests.engine.test_lora import merged_transformers

MODEL = "tiny-llama"
PROMPT = [17, 230, 41, 99, 310, 5, 72]
OPTIONS = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 64, "enable_lora": True}


def _state(path: Path, adapters: list[str]) -> ServerState:
    config = EngineArgs(model=str(path), **OPTIONS).create_engine_config()
    state = ServerState(ServerSettings((MODEL,), str(path), lora_modules=lora_modules(adapters, True)))
    load_engine(state, config, "http://127.0.0.1:0")
    return state


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path, Path]]:
    path = tiny_checkpoints["llama"]
    adapter = make_lora_adapter(path, tmp_path_factory.mktemp("lora") / "tuned", seed=1)
    state = _state(path, [f"tuned={adapter}"])
    assert state.load_error is None, state.load_error
    yield TestClient(build_app(state)), path, adapter
    state.engine.shutdown()


def _tokens(client: TestClient, model: str) -> dict:
    answer = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_requests_model_naming_the_adapter_runs_with_it(served) -> None:
    client, path, adapter = served
    tuned = _tokens(client, "tuned")
    assert tuned["model"] == "tuned"
    assert tuned["choices"][0]["token_ids"] == hf_greedy(merged_transformers(path, adapter), PROMPT, 6)
    base = _tokens(client, MODEL)["choices"][0]["token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert base == hf_greedy(hf, PROMPT, 6) != tuned["choices"][0]["token_ids"]


def test_an_embedding_naming_the_adapter_is_the_engines_with_it(served) -> None:
    client, _, _ = served
    state = client.app.state.server

    def embedding(model: str) -> torch.Tensor:
        answer = client.post("/v1/embeddings", json={"model": model, "input": PROMPT})
        assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
        return torch.tensor(answer.json()["data"][0]["embedding"])

    async def engines_own() -> torch.Tensor:
        (out,) = await state.engine.encode([{"prompt_token_ids": PROMPT}], PoolingParams(),
                                           lora_request=state.adapters.get("tuned"))
        return out.outputs.data

    tuned = embedding("tuned")
    assert torch.allclose(tuned, asyncio.run(engines_own()), atol=1e-5)
    assert not torch.allclose(tuned, embedding(MODEL), atol=1e-3)


def test_models_lists_the_adapter_with_the_base_model_as_parent(served) -> None:
    client, path, adapter = served
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL, "tuned"}
    assert (cards["tuned"]["root"], cards["tuned"]["parent"]) == (str(adapter), MODEL)
    assert cards[MODEL]["parent"] is None
    assert client.get("/v1/models/tuned").json()["parent"] == MODEL


def test_an_unknown_model_is_a_404_naming_it_and_the_adapters(served) -> None:
    client, _, _ = served
    answer = client.post("/v1/chat/completions", json={"model": "other-adapter", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert "'other-adapter' does not exist" in error["message"] and "tuned" in error["message"]
    assert error["param"] == "model"


def test_beam_search_with_an_adapter_is_refused_by_name(served) -> None:
    client, _, _ = served
    answer = client.post("/v1/completions", json={"model": "tuned", "prompt": PROMPT, "max_tokens": 2,
                                                   "use_beam_search": True, "n": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "use_beam_search"


def test_a_bad_adapter_stops_the_start_up_naming_it(tiny_checkpoints, tmp_path) -> None:
    state = _state(tiny_checkpoints["llama"], [f"missing={tmp_path}"])
    assert state.engine is None
    assert "LoRA adapter 'missing': no adapter_config.json" in str(state.load_error)


def test_lora_modules_flags_are_checked() -> None:
    assert lora_modules(["a=/x", "b=/y=z"], True) == (LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y=z"))
    with pytest.raises(ValueError, match="--enable-lora"):
        lora_modules(["a=/x"], False)
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_modules(['{"name": "a", "path": "/x"}'], True)
    with pytest.raises(ValueError, match="tiny-llama is a served model name too"):
        ServerSettings((MODEL,), "root", lora_modules=lora_modules([f"{MODEL}=/x"], True))
