"""LoRA adapters loaded and unloaded at runtime (--allow-runtime-lora-updating), as vLLM's server does it: a loaded
adapter is served at once (``model`` selects it, /v1/models lists it), a bad one or a name served already is a 400
naming what is wrong and leaves the server as it was, an unloaded name is a 404 while the requests already streaming
with it finish with their tokens, its weights going after them and no KV block held; without the flag the routes
are a 404 saying how to turn them on; /metrics names the adapters of running and waiting requests."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import uvicorn

from kvserve.cli_serve import runtime_lora_updating
from kvserve.engine_args import EngineArgs
from kvserve.model.lora_checkpoint import make_lora_adapter
from kvserve.server.app import build_app
from kvserve.server.launch import load_engine
from kvserve.server.sockets import UVICORN_PROTOCOLS
from kvserve.server.state import ServerSettings, ServerState
from tests.conftest import assert_all_blocks_free
from tests.server.conftest import free_port, scrape
from tests.server.test_app_fake_engine import wait_until

MODEL = "tiny-llama"
PROMPT = [17, 230, 41, 99, 310, 5, 72, 8, 150, 61, 33, 4]
OPTIONS = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "max_model_len": 256, "enable_lora": True}


class Served:
    """A real engine behind uvicorn on a thread (streams are read as they come)."""

    def __init__(self, path: Path, **settings) -> None:
        config = EngineArgs(model=str(path), **OPTIONS).create_engine_config()
        self.state = ServerState(ServerSettings((MODEL,), str(path), **settings))
        load_engine(self.state, config, "http://127.0.0.1:0")
        assert self.state.load_error is None, self.state.load_error
        self.url = f"http://127.0.0.1:{free_port()}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.state), port=int(self.url.rsplit(":", 1)[1]),
                                                    log_level="warning", **UVICORN_PROTOCOLS))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), "uvicorn to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.state.engine.shutdown()

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=30)

    def installed(self) -> set[int]:
        """The adapter ids on the model's layers (read while the engine is idle)."""
        runner = self.state.engine.engine.core.runner
        return {i for layer, _ in runner.model.lora_projections().values() for i in layer.lora}


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    base = tiny_checkpoints["llama"]
    root = tmp_path_factory.mktemp("served-adapters")
    return base, make_lora_adapter(base, root / "first", seed=1), make_lora_adapter(base, root / "second", seed=2)


@pytest.fixture(scope="module")
def served(adapters) -> Iterator[Served]:
    server = Served(adapters[0], allow_runtime_lora_updating=True)
    yield server
    server.stop()


def _completion(served: Served, model: str, max_tokens: int = 6) -> dict:
    answer = served.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                             "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _models(served: Served) -> dict[str, dict]:
    return {card["id"]: card for card in httpx.get(served.url + "/v1/models").json()["data"]}


def test_a_loaded_adapter_is_served_at_once_and_unloaded_is_gone(served: Served, adapters) -> None:
    _, first, _ = adapters
    base_text = _completion(served, MODEL)["choices"][0]["text"]
    answer = served.post("/v1/load_lora_adapter", {"lora_name": "first", "lora_path": str(first)})
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'first' added successfully.")
    assert _models(served)["first"]["root"] == str(first) and _models(served)["first"]["parent"] == MODEL
    tuned = _completion(served, "first")
    assert tuned["model"] == "first" and tuned["choices"][0]["text"] != base_text
    answer = served.post("/v1/unload_lora_adapter", {"lora_name": "first"})
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'first' removed successfully.")
    assert "first" not in _models(served) and not served.installed()
    gone = served.post("/v1/completions", {"model": "first", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and "'first' does not exist" in gone.json()["error"]["message"]
    missing = served.post("/v1/unload_lora_adapter", {"lora_name": "first"})
    assert missing.status_code == 404 and "'first' cannot be found" in missing.json()["error"]["message"]
    # the same content under a new name: the same tokens, and its prompt's KV found by the adapter's digest
    assert served.post("/v1/load_lora_adapter", {"lora_name": "again", "lora_path": str(first)}).status_code == 200
    again = _completion(served, "again")
    assert again["choices"][0]["text"] == tuned["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert served.post("/v1/unload_lora_adapter", {"lora_name": "again"}).status_code == 200
    assert_all_blocks_free(served.state.engine)


@pytest.mark.parametrize("body, status, param, message", [
    ({"lora_name": MODEL, "lora_path": "/x"}, 400, "lora_name", f"the model '{MODEL}' has already been loaded"),
    ({"lora_name": "bad", "lora_path": "/nowhere"}, 400, "lora_path", "LoRA adapter 'bad': no adapter_config.json"),
    ({"lora_name": "bad", "lora_path": "/x", "load_inplace": True}, 400, "load_inplace", "not implemented"),
    ({"lora_name": "bad"}, 400, "lora_path", "lora_path"),
    ({"lora_name": "bad", "lora_path": "/x", "base_model_name": "m"}, 400, "base_model_name", "base_model_name"),
])
def test_a_bad_load_is_a_400_naming_what_is_wrong(served: Served, body: dict, status: int, param: str,
                                                  message: str) -> None:
    answer = served.post("/v1/load_lora_adapter", body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert set(_models(served)) == {MODEL} and not served.installed()
    _completion(served, MODEL)  # the server unharmed


def test_an_adapter_too_large_or_a_name_served_already_is_refused(served: Served, adapters, tmp_path) -> None:
    base, first, second = adapters
    wide = make_lora_adapter(base, tmp_path / "wide", rank=32, seed=3)
    answer = served.post("/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(wide)})
    assert answer.status_code == 400 and "rank 32 is above max_lora_rank=16" in answer.json()["error"]["message"]
    assert served.post("/v1/load_lora_adapter", {"lora_name": "first", "lora_path": str(first)}).status_code == 200
    twice = served.post("/v1/load_lora_adapter", {"lora_name": "first", "lora_path": str(second)})
    assert twice.status_code == 400 and "'first' has already been loaded" in twice.json()["error"]["message"]
    by_id = served.post("/v1/unload_lora_adapter", {"lora_name": "first", "lora_int_id": 1})
    assert by_id.status_code == 400 and by_id.json()["error"]["param"] == "lora_int_id"
    assert served.post("/v1/unload_lora_adapter", {"lora_name": "first"}).status_code == 200
    assert not served.installed()


def test_unloading_an_adapter_a_request_streams_with_lets_it_finish_untouched(served: Served, adapters,
                                                                             monkeypatch) -> None:
    """The stream's text is the text of the same request run alone; the unload says the request still runs; once it
    is done the adapter's weights are gone and every KV block is free."""
    _, first, _ = adapters
    assert served.post("/v1/load_lora_adapter", {"lora_name": "first", "lora_path": str(first)}).status_code == 200
    alone = _completion(served, "first", max_tokens=200)["choices"][0]["text"]
    on_step = served.state.metrics.on_step  # steps of 5 ms at least: the stream outlasts the unload's round trip
    monkeypatch.setattr(served.state.metrics, "on_step", lambda *args: (on_step(*args), time.sleep(0.005)))
    body = {"model": "first", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        texts = [json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"]]
        unload = served.post("/v1/unload_lora_adapter", {"lora_name": "first"})
        assert unload.status_code == 200 and "1 requests still running or waiting with it" in unload.text
        texts += [json.loads(line.removeprefix("data: "))["choices"][0]["text"] for line in lines
                  if line.startswith("data: {")]
    assert "".join(texts) == alone
    wait_until(lambda: not served.state.engine.num_unfinished(), "the stream's request to finish")
    assert not served.installed()
    assert_all_blocks_free(served.state.engine)


def test_metrics_name_the_adapters_of_running_and_waiting_requests(served: Served, adapters, monkeypatch) -> None:
    """max_loras 1: of two requests added together with two adapters, one runs while the other waits; the page
    holds one series of the gauge at a time, stamped with a Unix time."""
    _, first, second = adapters
    for name, path in (("first", first), ("second", second)):
        assert served.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}).status_code == 200
    metrics = served.state.metrics
    pages: list[str] = []
    on_step = metrics.on_step
    monkeypatch.setattr(metrics, "on_step", lambda *args: (on_step(*args), pages.append(metrics.render().decode())))
    gate = threading.Event()  # the engine thread held, so that both requests are added in one drain of commands
    holder = threading.Thread(target=lambda: asyncio.run(served.state.engine.call(lambda _: gate.wait(10))))
    holder.start()
    requests = [threading.Thread(target=_completion, args=(served, name, 20)) for name in ("first", "second")]
    for request in requests:
        request.start()
    wait_until(lambda: served.state.engine.num_waiting() == 2, "both requests to be on their way")
    time.sleep(0.3)  # from the inputs thread onto the engine's queue
    gate.set()
    for thread in (holder, *requests):
        thread.join(30)
    series = [[line for line in page.splitlines() if line.startswith("kvserve:lora_requests_info{")]
              for page in pages]
    assert all(len(lines) == 1 for lines in series), series
    labels = [dict(re.findall(r'(\w+)="([^"]*)"', lines[0])) for lines in series]
    seen = {(label["running_lora_adapters"], label["waiting_lora_adapters"]) for label in labels}
    assert {("first", "second"), ("second", "first")} & seen, seen
    page = httpx.get(served.url + "/metrics").text
    assert scrape(page, "kvserve:lora_requests_info", running_lora_adapters="", waiting_lora_adapters="",
                  max_lora="1") > 1e9  # a Unix time
    for name in ("first", "second"):
        assert served.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_without_the_flag_the_routes_are_a_404_saying_how_to_turn_them_on(adapters) -> None:
    base, first, _ = adapters
    server = Served(base)
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            answer = server.post(path, {"lora_name": "first", "lora_path": str(first)})
            assert answer.status_code == 404 and "--allow-runtime-lora-updating" in answer.json()["error"]["message"]
        assert set(_models(server)) == {MODEL} and not server.installed()
    finally:
        server.stop()


def test_the_flag_or_vllms_variable_turns_it_on_with_lora_only(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert (runtime_lora_updating(False, True), runtime_lora_updating(True, True)) == (False, True)
    with pytest.raises(ValueError, match="--allow-runtime-lora-updating loads LoRA adapters, which --enable-lora"):
        runtime_lora_updating(True, False)
    for value, allowed in (("1", True), ("True", True), ("0", False), ("no", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert runtime_lora_updating(False, True) is allowed
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    with pytest.raises(ValueError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING loads LoRA adapters"):
        runtime_lora_updating(False, False)


def test_a_request_on_its_way_as_its_adapter_is_unloaded_is_a_404_as_after(served: Served, adapters,
                                                                           monkeypatch) -> None:
    """The request named the adapter before the unload, but reaches the engine after it (its prompt was still
    being tokenized): the name's 404, not a 400 about an offline ``lora_request`` field the client never sent."""
    _, first, _ = adapters
    assert served.post("/v1/load_lora_adapter", {"lora_name": "first", "lora_path": str(first)}).status_code == 200
    processor = served.state.engine.engine.input_processor
    tokenizing, unloaded = threading.Event(), threading.Event()
    process = processor.process

    def held_process(*args, **kwargs):
        tokenizing.set()
        unloaded.wait(10)
        return process(*args, **kwargs)

    monkeypatch.setattr(processor, "process", held_process)
    answer: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answer.append(served.post(
        "/v1/completions", {"model": "first", "prompt": PROMPT, "max_tokens": 2})))
    request.start()
    assert tokenizing.wait(10)
    assert served.post("/v1/unload_lora_adapter", {"lora_name": "first"}).status_code == 200
    unloaded.set()
    request.join(30)
    error = answer[0].json()["error"]
    assert answer[0].status_code == 404 and error["param"] == "model", answer[0].text
    assert "'first' does not exist" in error["message"]
    assert not served.installed()
    assert_all_blocks_free(served.state.engine)
