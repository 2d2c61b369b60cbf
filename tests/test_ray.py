"""``serve run kvserve.ray:app``: two engine replicas on a local Ray cluster (``ray.init(num_cpus=2)``) behind
the ingress, serving the openai SDK with the same text as the engine offline, a shared prefix kept on one
replica by the request router, errors relayed, and options checked before any replica starts. Needs Ray Serve
(``pip install 'kvserve[ray]'``), which CI does not install."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

import ray  # noqa: E402
from openai import OpenAI  # noqa: E402
from ray import serve  # noqa: E402
from starlette.requests import Request  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.ray import Ingress, ProxiedRequest, app, replica_options, serve_arguments  # noqa: E402
from tests.router.test_router_e2e import MAX_MODEL_LEN, MODEL_NAME, checkpoint  # noqa: E402,F401 (a fixture)
from tests.server.conftest import free_port  # noqa: E402

PREFIX = "You are a careful assistant who answers questions about the weather in short sentences. " * 3


@pytest.fixture(scope="module")
def deployment(checkpoint: Path):  # noqa: F811
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = {"model": str(checkpoint), "served_model_name": MODEL_NAME, "num_kv_blocks": "256",
               "max_model_len": str(MAX_MODEL_LEN), "device": "cpu", "data_parallel_size": "2",
               "replica_cpus": "0.5"}
    serve.run(app(options), name="kvserve", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_the_openai_sdk_gets_the_engines_own_text(deployment: str, checkpoint: Path) -> None:  # noqa: F811
    client = OpenAI(base_url=f"{deployment}/v1", api_key="unused")
    prompts = ["hello there", "the weather is"]
    served = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
              for p in prompts]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL_NAME, prompt=prompts[0], max_tokens=8, temperature=0, stream=True))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    offline = LLM(str(checkpoint), device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    expected = [out.outputs[0].text for out in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    assert served == expected
    assert streamed == expected[0]
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_responses_and_messages_reach_an_engine_with_the_chat_answer(deployment: str) -> None:
    """The two APIs served as the chat request they stand for, through the ingress: the chat answer's text; an
    error on Anthropic's route (the ingress's own 404 included) in Anthropic's shape."""
    client = OpenAI(base_url=f"{deployment}/v1", api_key="unused")
    user = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=user, max_tokens=4, temperature=0)
    response = client.responses.create(model=MODEL_NAME, input=user, max_output_tokens=4, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    messages = httpx.post(f"{deployment}/v1/messages", timeout=120, json={
        "model": MODEL_NAME, "messages": user, "max_tokens": 4, "temperature": 0})
    assert messages.status_code == 200, messages.text
    assert messages.json()["content"][0]["text"] == chat.choices[0].message.content
    no_max_tokens = httpx.post(f"{deployment}/v1/messages", json={"model": MODEL_NAME, "messages": user}, timeout=60)
    no_route = httpx.get(f"{deployment}/v1/messages", timeout=60)  # the ingress's own answer
    for refused, status in ((no_max_tokens, 400), (no_route, 404)):
        assert refused.status_code == status and refused.json()["type"] == "error", refused.text


def test_a_shared_prefix_stays_on_one_replica(deployment: str) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0}
    replicas = []
    for i in range(6):
        reply = httpx.post(f"{deployment}/v1/completions", json={**body, "prompt": PREFIX + f"question {i}"},
                           timeout=120)
        assert reply.status_code == 200, reply.text
        replicas.append(reply.headers["x-kvserve-replica"])
    assert len(set(replicas)) == 1


def test_a_burst_sharing_a_prefix_stays_on_one_replica(deployment: str) -> None:
    """Sent at once, the requests are chosen for before any is routed: the prefix counts from the choice."""
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0}
    other_prefix = "Summarise the following meeting notes for the team, in three bullet points. " * 3

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            replies = await asyncio.gather(*(client.post(f"{deployment}/v1/completions", json={
                **body, "prompt": other_prefix + f"note {i}"}) for i in range(6)))
        assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
        return [reply.headers["x-kvserve-replica"] for reply in replies]

    assert len(set(asyncio.run(burst()))) == 1


def test_tokenize_and_detokenize_reach_an_engine(deployment: str) -> None:
    tokens = httpx.post(f"{deployment}/tokenize", json={"prompt": "hello there"}, timeout=60)
    assert tokens.status_code == 200, tokens.text
    text = httpx.post(f"{deployment}/detokenize", json={"tokens": tokens.json()["tokens"]}, timeout=60)
    assert text.status_code == 200 and "hello there" in text.json()["prompt"], text.text


def test_errors_are_relayed_as_openai_errors(deployment: str) -> None:
    bad_json = httpx.post(f"{deployment}/v1/completions", content=b"{not json", timeout=60,
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    unknown = httpx.post(f"{deployment}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert httpx.get(f"{deployment}/v1/models", timeout=60).json()["data"][0]["id"] == MODEL_NAME


def test_bad_options_are_named_before_anything_starts() -> None:
    assert serve_arguments({"model": "m", "max_num_seqs": "3", "enable_prefix_caching": "false"}).max_num_seqs == 3
    assert serve_arguments({"allow_credentials": "true", "disable_uvicorn_access_log": "true"}).allow_credentials
    with pytest.raises(ValueError, match="no_such_option"):
        serve_arguments({"no_such_option": "1"})
    with pytest.raises(ValueError, match="enable_prefix_caching takes true or false"):
        serve_arguments({"enable_prefix_caching": "maybe"})
    with pytest.raises(ValueError, match="routing policy"):
        app({"routing_policy": "random"})
    assert serve_arguments({"enable_lora": "true", "allow_runtime_lora_updating": "true"}).allow_runtime_lora_updating
    with pytest.raises(ValueError, match="LoRA adapters at runtime is not served through Ray Serve"):
        app({"enable_lora": "true", "allow_runtime_lora_updating": "true"})


def test_the_ingress_says_runtime_lora_updates_are_not_served_through_ray() -> None:
    """A handle call reaches one engine replica: a load there would leave the others without the adapter."""
    class NoEngines:
        def options(self, **_: object) -> NoEngines:
            return self

    ingress = Ingress(NoEngines())
    scope = {"type": "http", "method": "POST", "path": "/v1/load_lora_adapter", "headers": [], "query_string": b""}
    answer = asyncio.run(ingress(Request(scope)))
    assert answer.status_code == 404 and b"give the adapters as lora_modules" in answer.body


def test_a_replica_reserves_its_tensor_parallel_group_on_one_node() -> None:
    assert replica_options({"model": "m"}, 1.0, 0.0) == {"ray_actor_options": {"num_cpus": 1.0}}
    assert replica_options({"model": "m", "tensor_parallel_size": "4"}, 0.5, 1.0) == {
        "ray_actor_options": {"num_cpus": 2.0, "num_gpus": 4.0}}
    assert replica_options({"model": "m", "tensor_parallel_size": "2", "distributed_executor_backend": "ray"},
                           0.5, 1.0) == {
        "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1.0},
        "placement_group_bundles": [{"CPU": 0.5, "GPU": 1.0}] * 2, "placement_group_strategy": "STRICT_PACK"}


def test_ray_tensor_parallel_ranks_run_in_the_replicas_own_placement_group(deployment: str,  # noqa: F811
                                                                           checkpoint: Path) -> None:
    """The cluster's 2 CPUs hold the two replicas of ``deployment`` (0.5 each) and this one's two bundles of
    0.5: a replica that reserved a second group for its Ray ranks would never be placed."""
    options = {"model": str(checkpoint), "served_model_name": MODEL_NAME, "num_kv_blocks": "64",
               "max_model_len": str(MAX_MODEL_LEN), "device": "cpu", "replica_cpus": "0.5",
               "tensor_parallel_size": "2", "distributed_executor_backend": "ray"}
    serve.run(app(options), name="kvserve-tp", route_prefix="/tp")
    try:
        engine = serve.get_deployment_handle("kvserve-engine", app_name="kvserve-tp").options(stream=True)
        body = json.dumps({"model": MODEL_NAME, "prompt": "the weather is", "max_tokens": 8, "temperature": 0})
        request = ProxiedRequest("POST", "/v1/completions", body.encode(), (("content-type", "application/json"),))
        start, *chunks = list(engine.handle.remote(request))
        assert start.status == 200, b"".join(chunks)
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert [len(g["bundles"]) for g in groups] == [2], groups  # the TP replica's group, and no other
    finally:
        serve.delete("kvserve-tp")
    offline = LLM(str(checkpoint), device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    expected = offline.generate(["the weather is"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert json.loads(b"".join(chunks))["choices"][0]["text"] == expected
