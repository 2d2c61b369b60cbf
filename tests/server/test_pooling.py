"""The pooling endpoints of a real ``kvserve serve`` over the tiny seeded Llama: the engine's own vectors through the
openai SDK (floats and base64) and httpx, a score and a rerank made of them, the refusals the engine makes
(``dimensions``), and the servers whose ``--runner`` leaves a task out."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from kvserve.pooling_params import PoolingParams
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, NUM_KV_BLOCKS, ServerProcess

PROMPTS = ["The capital of France is", "Paris is a city"]


@pytest.fixture(scope="module")
def engine_vectors(tiny_checkpoint: Path) -> Iterator:
    """``vectors(prompts, params)``: the engine's own pooled vectors (``AsyncEngine.encode``) for the checkpoint and
    options the shared server runs."""
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine_args import EngineArgs

    args = EngineArgs(model=str(tiny_checkpoint), device="cpu", num_kv_blocks=NUM_KV_BLOCKS,
                      max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(LLMEngine(args.create_engine_config()))
    engine.start()

    def vectors(prompts: list, params: PoolingParams = PoolingParams()) -> list[torch.Tensor]:
        async def encode() -> list[torch.Tensor]:
            return [out.outputs.data for out in await engine.encode(prompts, params)]

        return asyncio.run(encode())

    yield vectors
    engine.shutdown()


def test_an_embedding_is_the_engines_own_in_floats_and_in_base64(client: openai.OpenAI, engine_vectors) -> None:
    want = engine_vectors(PROMPTS)
    floats = client.embeddings.create(model=MODEL_NAME, input=PROMPTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.model == MODEL_NAME
    for got, expected in zip(floats.data, want):
        assert torch.allclose(torch.tensor(got.embedding), expected, atol=1e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(PROMPTS)
    decoded = client.embeddings.create(model=MODEL_NAME, input=PROMPTS)  # base64, the SDK's default with numpy
    assert [d.embedding for d in decoded.data] == [d.embedding for d in floats.data]


def test_raw_base64_decodes_to_the_same_floats(server: ServerProcess, engine_vectors) -> None:
    body = {"model": MODEL_NAME, "input": PROMPTS[0], "encoding_format": "base64"}
    answer = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()
    vector = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4")
    assert torch.allclose(torch.from_numpy(vector.copy()), engine_vectors([PROMPTS[0]])[0], atol=1e-5)


def test_pooling_answers_the_engines_token_vectors(server: ServerProcess, engine_vectors) -> None:
    body = {"model": MODEL_NAME, "input": PROMPTS[0], "task": "token_embed"}
    answer = httpx.post(f"{server.url}/pooling", json=body, timeout=60).json()
    (want,) = engine_vectors([PROMPTS[0]], PoolingParams(task="token_embed"))
    got = torch.tensor(answer["data"][0]["data"])
    assert got.shape == want.shape and answer["usage"]["prompt_tokens"] == want.shape[0]
    assert torch.allclose(got, want, atol=1e-5)


def test_score_and_rerank_are_the_cosine_similarity_of_the_engines_embeddings(server: ServerProcess,
                                                                              engine_vectors) -> None:
    query, documents = "Where is Paris?", ["Paris is in France", "Bananas are yellow", "France's capital"]
    vectors = engine_vectors([query, *documents])
    want = [torch.nn.functional.cosine_similarity(vectors[0], v, dim=0).item() for v in vectors[1:]]
    score = httpx.post(f"{server.url}/score", json={"model": MODEL_NAME, "text_1": query, "text_2": documents},
                       timeout=60).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
    rerank = httpx.post(f"{server.url}/v1/rerank", json={"model": MODEL_NAME, "query": query, "documents": documents,
                                                         "top_n": 2}, timeout=60).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in rerank["results"]] == order
    assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx([want[i] for i in order], abs=1e-5)
    assert [r["document"]["text"] for r in rerank["results"]] == [documents[i] for i in order]


def test_the_engine_refuses_dimensions_and_the_server_says_so(server: ServerProcess) -> None:
    answer = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL_NAME, "input": "a", "dimensions": 4})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "dimensions", answer.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": ["a", "b " * MAX_MODEL_LEN]}, "input"),
    ("/pooling", {"input": [[1, 10**9]]}, "input"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "b " * MAX_MODEL_LEN}]}, "messages"),
    ("/score", {"text_1": "a", "text_2": "b " * MAX_MODEL_LEN}, "text_1 or text_2"),
    ("/rerank", {"query": "a", "documents": ["b " * MAX_MODEL_LEN]}, "query or documents"),
])
def test_a_prompt_the_engine_refuses_is_named_by_the_field_it_came_in(server: ServerProcess, path: str, body: dict,
                                                                      param: str) -> None:
    answer = httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert answer.json()["error"]["message"].startswith(param), answer.text


def test_a_pooling_request_counts_in_the_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    before = server.metric("kvserve:prompt_tokens_total"), server.metric("kvserve:request_success_total",
                                                                         finished_reason="stop")
    usage = client.embeddings.create(model=MODEL_NAME, input=PROMPTS, encoding_format="float").usage
    after = server.metric("kvserve:prompt_tokens_total"), server.metric("kvserve:request_success_total",
                                                                        finished_reason="stop")
    assert (after[0] - before[0], after[1] - before[1]) == (usage.prompt_tokens, 2)
    assert server.metric("kvserve:kv_cache_usage_perc") == 0


def test_a_client_that_leaves_aborts_its_pooling_requests_and_frees_their_blocks(server: ServerProcess) -> None:
    aborted = server.metric("kvserve:request_success_total", finished_reason="abort")
    batch = {"model": MODEL_NAME, "input": [[7 + i] * (MAX_MODEL_LEN - 8) for i in range(256)]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/embeddings", json=batch, timeout=0.3)
    deadline = time.monotonic() + 30
    while server.metric("kvserve:num_requests_running") + server.metric("kvserve:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the batch's requests were not aborted"
        time.sleep(0.05)
    assert server.metric("kvserve:request_success_total", finished_reason="abort") > aborted
    assert server.metric("kvserve:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("runner, refused_path, body, runner_named", [
    ("generate", "/v1/embeddings", {"input": "a"}, "--runner pooling"),
    ("pooling", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
     "--runner generate"),
])
def test_a_runner_refuses_the_other_kind_of_request_naming_the_option(tiny_checkpoint: Path, runner: str,
                                                                      refused_path: str, body: dict,
                                                                      runner_named: str) -> None:
    """As `kvserve serve --runner ...` loads its engine (warmed up: a pooling one could not start)."""
    from kvserve.engine_args import EngineArgs
    from kvserve.server.app import build_app
    from kvserve.server.launch import load_engine
    from kvserve.server.state import ServerSettings, ServerState

    config = EngineArgs(model=str(tiny_checkpoint), device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN,
                        runner=runner).create_engine_config()
    state = ServerState(ServerSettings((MODEL_NAME,), str(tiny_checkpoint)))
    load_engine(state, config, "http://127.0.0.1:0")
    assert state.load_error is None, state.load_error
    try:
        client = TestClient(build_app(state))
        refused = client.post(refused_path, json={"model": MODEL_NAME, **body})
        assert refused.status_code == 400 and runner_named in refused.json()["error"]["message"], refused.text
        served = ({"prompt": "hi", "max_tokens": 2}, "/v1/completions") if runner == "generate" else (
            {"input": "hi"}, "/v1/embeddings")
        assert client.post(served[1], json={"model": MODEL_NAME, **served[0]}).status_code == 200
    finally:
        state.engine.shutdown()
