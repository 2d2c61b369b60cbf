"""The pooling endpoints in-process over the model-free FakeEngine and a fake of ``AsyncEngine.encode`` (its
contract: all prompts queued or none, InvalidParameter before queueing, a cancelled await aborts): the answers'
shapes, the refusals, admission, disconnects, ids and logging. ``test_pooling.py`` runs them against the real engine.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
from typing import Any, Iterator

import httpx
import numpy as np
import openai
import pytest
import torch

from kvserve.lora_request import LoRARequest
from kvserve.outputs import PoolingOutput, PoolingRequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import InvalidParameter
from tests.server.test_app_fake_engine import MODEL, InProcessServer, wait_until

DIM = 8
ADAPTER = LoRARequest("sql", 1, "/adapters/sql")


def fake_vector(token_ids: list[int], params: PoolingParams) -> torch.Tensor:
    """A token's row: 1 + the one-hot of its id mod ``DIM``; a prompt's: the rows' mean, normalized by default."""
    rows = torch.nn.functional.one_hot(torch.tensor(token_ids) % DIM, DIM).float() + 1
    if params.task == "token_embed":
        return rows
    mean = rows.mean(0)
    return mean if params.normalize is False else mean / mean.norm()


class FakeEncoder:
    """``AsyncEngine.encode`` over the byte tokenizer; notes each call; ``hold`` keeps calls waiting (a slow
    engine), ``cancelled`` counts those whose await was cancelled (the real engine aborts their requests)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.hold = False
        self.cancelled = 0
        self.aborting = False  # every request aborted by the engine (a shutdown's abort_all): no vector

    async def __call__(self, prompts, params, request_ids=None, admission=None, priority=0, lora_request=None):
        if params.dimensions is not None:
            raise InvalidParameter("dimensions", "dimensions is not supported: no served model is matryoshka-trained")
        token_ids = [list(p.encode()) if isinstance(p, str) else p.get("prompt_token_ids") or list(p["prompt"].encode())
                     for p in prompts]
        if admission is not None:
            admission.close()
        self.calls.append({"prompts": list(prompts), "params": params, "request_ids": list(request_ids),
                           "priority": priority, "lora_request": lora_request})
        try:
            while self.hold:
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return [PoolingRequestOutput(rid, None if self.aborting else PoolingOutput(fake_vector(ids, params)), ids,
                                     True) for rid, ids in zip(request_ids, token_ids)]


@pytest.fixture(scope="module")
def srv() -> Iterator[InProcessServer]:
    server = InProcessServer(lora_modules=(ADAPTER,))
    server.state.engine.encode = FakeEncoder()
    yield server
    server.stop()


@pytest.fixture()
def encoder(srv: InProcessServer) -> FakeEncoder:
    srv.state.engine.encode.calls.clear()
    return srv.state.engine.encode


@pytest.fixture(scope="module")
def client(srv: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def embed(text: str | list[int], **params: Any) -> list[float]:
    token_ids = list(text.encode()) if isinstance(text, str) else text
    return fake_vector(token_ids, PoolingParams(**params)).tolist()


def post(srv: InProcessServer, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json={"model": MODEL, **body}, timeout=30, **kwargs)


def test_embeddings_parse_in_the_openai_sdk_as_floats_and_as_base64(client: openai.OpenAI,
                                                                    encoder: FakeEncoder) -> None:
    floats = client.embeddings.create(model=MODEL, input=["ab", "cde"], encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL and floats.id.startswith("embd-")
    assert [(d.object, d.index) for d in floats.data] == [("embedding", 0), ("embedding", 1)]
    assert np.allclose(floats.data[1].embedding, embed("cde"), atol=1e-6)
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (5, 5)
    # left out, the SDK asks for base64 (numpy is installed) and decodes it as little-endian float32
    decoded = client.embeddings.create(model=MODEL, input=["ab", "cde"])
    assert [d.embedding for d in decoded.data] == [d.embedding for d in floats.data]
    assert encoder.calls[0]["params"] == PoolingParams(task="embed")


def test_base64_is_the_little_endian_float32_bytes(srv: InProcessServer) -> None:
    answer = post(srv, "/v1/embeddings", {"input": "ab", "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == torch.tensor(embed("ab")).tolist()
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2,
                               "prompt_tokens_details": {"cached_tokens": 0}}


def test_every_input_kind_reaches_the_engine_as_it_takes_prompts(srv: InProcessServer, encoder: FakeEncoder) -> None:
    for value, prompts in [("ab", ["ab"]), (["ab", "c"], ["ab", "c"]), ([97, 98], [{"prompt_token_ids": [97, 98]}]),
                           ([[97], [98, 99]], [{"prompt_token_ids": [97]}, {"prompt_token_ids": [98, 99]}])]:
        answer = post(srv, "/v1/embeddings", {"input": value})
        assert answer.status_code == 200, answer.text
        assert encoder.calls[-1]["prompts"] == prompts
    assert post(srv, "/v1/embeddings", {"input": "ab", "add_special_tokens": False}).status_code == 200
    assert encoder.calls[-1]["prompts"] == [{"prompt_token_ids": [97, 98]}]  # tokenized here, without BOS
    assert post(srv, "/v1/embeddings", {"input": ["ab", "c"], "cache_salt": "s"}).status_code == 200
    assert encoder.calls[-1]["prompts"] == [{"prompt": "ab", "cache_salt": "s"}, {"prompt": "c", "cache_salt": "s"}]
    assert post(srv, "/v1/embeddings", {"input": [99], "cache_salt": "s"}).status_code == 200
    assert encoder.calls[-1]["prompts"] == [{"prompt_token_ids": [99], "cache_salt": "s"}]


def test_a_conversation_is_rendered_without_the_generation_prompt_by_default(srv: InProcessServer,
                                                                             encoder: FakeEncoder) -> None:
    messages = [{"role": "user", "content": "hi"}]
    answer = post(srv, "/v1/embeddings", {"messages": messages}).json()
    assert encoder.calls[-1]["prompts"][0]["prompt"] == "<user>hi"
    assert answer["data"][0]["embedding"] == pytest.approx(embed("<user>hi"))
    post(srv, "/v1/embeddings", {"messages": messages, "add_generation_prompt": True})
    assert encoder.calls[-1]["prompts"][0]["prompt"] == "<user>hi<assistant>"


def test_the_vllm_extras_reach_the_engine(srv: InProcessServer, encoder: FakeEncoder) -> None:
    body = {"input": "ab", "truncate_prompt_tokens": 1, "normalize": False, "priority": -2, "user": "u-1"}
    answer = post(srv, "/v1/embeddings", body)
    assert answer.status_code == 200, answer.text
    call = encoder.calls[-1]
    assert call["params"] == PoolingParams(task="embed", normalize=False, truncate_prompt_tokens=1)
    assert call["priority"] == -2 and call["lora_request"] is None
    assert post(srv, "/v1/embeddings", {"input": "ab", "model": "sql"}).json()["model"] == "sql"
    assert encoder.calls[-1]["lora_request"] == ADAPTER


def test_an_answer_is_named_by_the_clients_request_id(srv: InProcessServer, encoder: FakeEncoder) -> None:
    by_header = post(srv, "/v1/embeddings", {"input": ["a", "b"]}, headers={"X-Request-Id": "trace-3"})
    assert by_header.json()["id"] == "embd-trace-3" and by_header.headers["x-request-id"] == "trace-3"
    engine_ids = encoder.calls[-1]["request_ids"]
    assert len(set(engine_ids)) == 2 and all(rid.startswith("embd-") and "trace" not in rid for rid in engine_ids)
    assert post(srv, "/pooling", {"input": "a", "request_id": "mine"}).json()["id"] == "pool-mine"
    assert post(srv, "/pooling", {"input": "a", "request_id": "a\nb"}).json()["error"]["param"] == "request_id"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": "a", "temperature": 0}, "temperature"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[]]}, "input"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input"),
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": "a", "messages": [{"role": "user", "content": "x"}]}, "input"),
    ("/v1/embeddings", {"input": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/v1/embeddings", {"messages": []}, "messages"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "bytes"}, "encoding_format"),
    ("/v1/embeddings", {"input": "a", "dimensions": 4}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "embed_dtype": "float16"}, "embed_dtype"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "a", "normalize": "yes"}, "normalize"),
    ("/pooling", {"input": "a", "task": "classify"}, "task"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/score", {"text_1": "a"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": "b", "queries": "c"}, "queries"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"data_1": {"content": [{"type": "image_url"}]}, "data_2": "b"}, "data_1"),
    ("/rerank", {"query": "a", "documents": "b"}, "documents"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": ["a"], "documents": ["b"]}, "query"),
    ("/v2/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": 9}, "max_tokens_per_doc"),
    # a batch admitted as one request: as many prompts as an embedding's input may hold, no more
    ("/v1/embeddings", {"input": ["a"] * 2049}, "input"),
    ("/score", {"text_1": "a", "text_2": ["b"] * 2048}, "text_2"),
    ("/score", {"queries": ["a"] * 1025, "documents": ["b"] * 1025}, "documents"),
    ("/rerank", {"query": "a", "documents": ["b"] * 2048}, "documents"),
])
def test_what_is_not_taken_is_a_400_naming_the_field(srv: InProcessServer, path: str, body: dict[str, Any],
                                                     param: str) -> None:
    answer = post(srv, path, body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def test_pooling_answers_a_vector_a_prompt_or_one_a_token(srv: InProcessServer) -> None:
    embedded = post(srv, "/pooling", {"input": ["ab"]}).json()
    assert embedded["object"] == "list" and embedded["id"].startswith("pool-")
    assert embedded["data"] == [{"object": "pooling", "index": 0, "data": pytest.approx(embed("ab"))}]
    tokens = post(srv, "/pooling", {"input": "abc", "task": "token_embed"}).json()
    assert tokens["data"][0]["data"] == embed("abc", task="token_embed") and tokens["usage"]["prompt_tokens"] == 3
    packed = post(srv, "/pooling", {"input": "abc", "task": "token_embed", "encoding_format": "base64"}).json()
    rows = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4").reshape(3, DIM)
    assert rows.tolist() == tokens["data"][0]["data"]


def cosine(a: str, b: str) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(embed(a)), torch.tensor(embed(b)), dim=0).item()


@pytest.mark.parametrize("first, second", [("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
                                           ("queries", "items")])
def test_score_pairs_one_to_n_and_n_to_n_by_cosine_similarity(srv: InProcessServer, encoder: FakeEncoder,
                                                              first: str, second: str) -> None:
    one_to_n = post(srv, "/score", {first: "ab", second: ["ab", "xyz"]}).json()
    assert one_to_n["object"] == "list" and one_to_n["id"].startswith("score-")
    assert [(d["object"], d["index"]) for d in one_to_n["data"]] == [("score", 0), ("score", 1)]
    assert [d["score"] for d in one_to_n["data"]] == pytest.approx([1.0, cosine("ab", "xyz")], abs=1e-6)
    assert encoder.calls[-1]["prompts"] == ["ab", "ab", "xyz"]  # the one first text embedded once
    assert one_to_n["usage"]["prompt_tokens"] == 7
    n_to_n = post(srv, "/v1/score", {first: ["ab", "cd"], second: ["xyz", "cd"]}).json()
    assert [d["score"] for d in n_to_n["data"]] == pytest.approx([cosine("ab", "xyz"), 1.0], abs=1e-6)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_ranks_documents_by_relevance_most_relevant_first(srv: InProcessServer, path: str) -> None:
    documents = ["ggg", "ab", "abh"]
    answer = post(srv, path, {"query": "ab", "documents": documents}).json()
    assert answer["id"].startswith("rerank-") and answer["model"] == MODEL
    assert [r["index"] for r in answer["results"]] == [1, 2, 0]
    assert [r["document"] for r in answer["results"]] == [{"text": "ab"}, {"text": "abh"}, {"text": "ggg"}]
    assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(
        [1.0, cosine("ab", "abh"), cosine("ab", "ggg")], abs=1e-6)
    assert answer["usage"] == {"prompt_tokens": 10, "total_tokens": 10}
    top = post(srv, path, {"query": "ab", "documents": documents, "top_n": 2, "return_documents": False}).json()
    assert top["results"] == [{k: v for k, v in r.items() if k != "document"} for r in answer["results"][:2]]


@pytest.mark.parametrize("path, body", [("/v1/embeddings", {"input": "a"}), ("/pooling", {"input": "a"}),
                                        ("/score", {"text_1": "a", "text_2": "b"}),
                                        ("/rerank", {"query": "a", "documents": ["b"]})])
def test_a_generate_only_runner_refuses_pooling_naming_the_runner(srv: InProcessServer, encoder: FakeEncoder,
                                                                  path: str, body: dict[str, Any]) -> None:
    srv.fake.supported_tasks = ("generate",)
    try:
        answer = post(srv, path, body)
    finally:
        srv.fake.supported_tasks = ("generate", "embed", "token_embed")
    assert answer.status_code == 400 and "--runner pooling" in answer.json()["error"]["message"], answer.text
    assert not encoder.calls


def test_an_embed_only_runner_refuses_token_embed(srv: InProcessServer) -> None:
    srv.fake.supported_tasks = ("embed",)
    try:
        answer = post(srv, "/pooling", {"input": "a", "task": "token_embed"})
    finally:
        srv.fake.supported_tasks = ("generate", "embed", "token_embed")
    assert answer.status_code == 400 and "token_embed" in answer.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
    ("/v1/responses", {"input": "a"}),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "a"}]}),
])
def test_a_pooling_runner_refuses_generation_naming_the_runner(srv: InProcessServer, path: str,
                                                               body: dict[str, Any]) -> None:
    srv.fake.supported_tasks = ("embed", "token_embed")
    try:
        answer = post(srv, path, body)
    finally:
        srv.fake.supported_tasks = ("generate", "embed", "token_embed")
    assert answer.status_code == 400, answer.text
    assert "--runner generate" in answer.text and "embed, token_embed" in answer.text


def test_a_client_that_leaves_aborts_its_requests(srv: InProcessServer, encoder: FakeEncoder) -> None:
    encoder.hold = True
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{srv.url}/v1/embeddings", json={"input": ["a", "b"]}, timeout=0.3)
        wait_until(lambda: encoder.cancelled == 1, "the encode to be cancelled")
    finally:
        encoder.hold = False


def test_requests_the_engine_aborted_are_a_503_to_retry(srv: InProcessServer, encoder: FakeEncoder) -> None:
    encoder.aborting = True
    try:
        answer = post(srv, "/v1/embeddings", {"input": ["a", "b"]})
    finally:
        encoder.aborting = False
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1", answer.text
    assert "shutting down" in answer.json()["error"]["message"]


def test_api_key_and_waiting_limit_hold_for_pooling() -> None:
    server = InProcessServer(api_keys=("k",), max_waiting=0)
    server.state.engine.encode = FakeEncoder()
    keyed = {"Authorization": "Bearer k"}
    bodies = {"/v1/embeddings": {"input": "a"}, "/pooling": {"input": "a"}, "/score": {"text_1": "a", "text_2": "b"},
              "/v1/score": {"text_1": "a", "text_2": "b"}, "/rerank": {"query": "a", "documents": ["b"]},
              "/v1/rerank": {"query": "a", "documents": ["b"]}, "/v2/rerank": {"query": "a", "documents": ["b"]}}
    try:
        for path, body in bodies.items():
            assert post(server, path, body).status_code == 401, path
            assert post(server, path, body, headers=keyed).status_code == 200, path
        server.fake.max_num_seqs = 0  # nothing runs: a completion stays waiting
        waiting = threading.Thread(target=lambda: post(server, "/v1/completions", {"prompt": "a"}, headers=keyed))
        waiting.start()
        wait_until(lambda: server.state.engine.num_waiting() > 0, "the completion to wait in the engine")
        refused = post(server, "/v1/embeddings", {"input": "a"}, headers=keyed)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        server.fake.max_num_seqs = 2
        waiting.join(10)
    finally:
        server.stop()


def test_a_logged_pooling_request_names_its_answer_and_how_it_ended(caplog) -> None:
    from kvserve.server.request_log import RequestLog

    server = InProcessServer(request_log=RequestLog(enabled=True))
    server.state.engine.encode = FakeEncoder()
    try:
        with caplog.at_level(logging.INFO, logger="kvserve.server.request_log"):
            post(server, "/v1/embeddings", {"input": "ab"}, headers={"X-Request-Id": "seen"})
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.server.request_log"]
    assert lines[0].startswith("request embd-seen (engine id embd-") and "prompt: 'ab'" in lines[0]
    assert "PoolingParams(task='embed'" in lines[0]
    assert lines[1].startswith("request embd-seen finished after") and "2 prompt tokens (0 cached), pooled" in lines[1]
