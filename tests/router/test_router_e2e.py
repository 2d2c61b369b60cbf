"""The router in front of real ``kvserve serve`` replicas: the same answers as one server, prefix affinity,
a replica killed mid-run, and ``serve --data-parallel-size`` starting and stopping its replicas."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, ServerProcess, free_port, scrape

PREFIX = "the shared system prompt of this group of requests, long enough for several chunks. " * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.model.checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("router-ckpt") / "llama", "llama", "tiny", seed=0)


def serve_flags(checkpoint: Path) -> list[str]:
    return [str(checkpoint), "--served-model-name", MODEL_NAME, "--num-kv-blocks", "256",
            "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu"]


class RouterProcess(ServerProcess):
    def __init__(self, workers: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"router-{self.port}.log"
        command = [sys.executable, "-m", "kvserve.cli", "router", "--port", str(self.port)]
        for worker in workers:
            command += ["--worker", worker]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("router-logs")
    replicas = [ServerProcess(serve_flags(checkpoint), log_dir) for _ in range(2)]
    for replica in replicas:
        replica.wait_ready()
    router = RouterProcess([r.url for r in replicas], log_dir)
    router.wait_ready()
    yield router, replicas
    for process in (router, *replicas):
        process.kill()


def wait_for_requests_on_replicas(url: str, count: int) -> None:
    """Until the replicas' pages, as the router shows them, count ``count`` requests running or waiting."""
    deadline = time.monotonic() + 60
    while sum(sample.value for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
              if family.name in ("kvserve:num_requests_running", "kvserve:num_requests_waiting")
              for sample in family.samples) < count:
        assert time.monotonic() < deadline, f"{count} requests did not reach the replicas"
        time.sleep(0.05)


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_router_answers_as_one_server_and_keeps_a_prefix_on_one_replica(cluster) -> None:
    router, replicas = cluster
    prompts = [PREFIX + f"question {i}" for i in range(6)]
    through_router = [complete(router.url, p)["choices"][0]["text"] for p in prompts]
    direct = [complete(replicas[1].url, p)["choices"][0]["text"] for p in prompts]
    assert through_router == direct
    metrics = httpx.get(f"{router.url}/metrics").text
    counts = sorted(requests_sent(metrics, r.url) for r in replicas)
    assert counts == [0.0, 6.0]  # the whole group on one replica
    assert all(scrape(metrics, "kvserve:num_requests_running", replica=r.url) >= 0 for r in replicas)  # theirs too
    assert list(text_string_to_metric_families(metrics))  # one page a scraper parses, HELP and TYPE once a family


def test_the_pooling_endpoints_go_through_the_router_and_keep_a_prefix_on_one_replica(cluster) -> None:
    """Run before the replica is killed: the router forwards embeddings and reranks, a shared prefix to one
    replica, answering what a replica answers."""
    router, replicas = cluster
    sent_before = [requests_sent(httpx.get(f"{router.url}/metrics").text, r.url) for r in replicas]
    body = {"model": MODEL_NAME, "input": [PREFIX + "embedded"], "encoding_format": "float"}
    through_router, direct = (httpx.post(f"{url}/v1/embeddings", json=body, timeout=60).json()
                              for url in (router.url, replicas[0].url))
    assert through_router["data"] == direct["data"] and through_router["usage"] == direct["usage"]
    for i in range(3):
        rerank = httpx.post(f"{router.url}/v2/rerank", timeout=60, json={
            "model": MODEL_NAME, "query": PREFIX + f"query {i}", "documents": ["a", "b"]})
        assert rerank.status_code == 200 and len(rerank.json()["results"]) == 2, rerank.text
    sent = [requests_sent(httpx.get(f"{router.url}/metrics").text, r.url) - before
            for r, before in zip(replicas, sent_before)]
    assert sorted(sent) == [0.0, 4.0]  # the prefix's requests on one replica


def requests_sent(metrics: str, url: str) -> float:
    try:
        return scrape(metrics, "kvserve_router:requests_total", replica=url)
    except KeyError:  # never chosen
        return 0.0


def test_a_replica_killed_mid_run_loses_only_its_own_requests(cluster) -> None:
    router, replicas = cluster
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(httpx.post, f"{router.url}/v1/completions", timeout=60,
                               json={"model": MODEL_NAME, "prompt": f"request {i} " * (1 + i % 5), "max_tokens": 64,
                                     "temperature": 0, "ignore_eos": True}) for i in range(16)]
        time.sleep(0.5)
        replicas[0].kill()
        answers = [f.result() for f in futures]
    assert all(a.status_code in (200, 502) for a in answers), [(a.status_code, a.text[:200]) for a in answers]
    assert sum(a.status_code == 200 for a in answers) >= 8  # the other replica's, at least
    after = [complete(router.url, f"after {i}") for i in range(4)]  # refused by the dead one: served elsewhere
    assert len(after) == 4 and httpx.get(f"{router.url}/health").status_code == 200


def test_serve_with_data_parallel_replicas_starts_and_stops_them(checkpoint: Path, tmp_path: Path) -> None:
    """SIGTERM drains the replicas as the router begins to stop, within --shutdown-timeout (0: what runs or waits
    is aborted at once): the router had waited for every stream to end by itself before telling them."""
    port = free_port()
    log = open(tmp_path / "dp.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", *serve_flags(checkpoint),
                                "--port", str(port), "--data-parallel-size", "2", "--shutdown-timeout", "0",
                                "--max-num-seqs", "1"], stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{url}/health", timeout=1)
                if health.status_code == 200 and len(health.json()["replicas_up"]) == 2:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the router was not healthy with two replicas:\n{(tmp_path / 'dp.log').read_text()}")
        assert complete(url, "hello")["choices"][0]["text"]
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True}
        with ThreadPoolExecutor(6) as pool:  # one running on each replica, the others waiting behind them
            streams = [pool.submit(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120).text)
                       for _ in range(6)]
            wait_for_requests_on_replicas(url, len(streams))
            process.send_signal(signal.SIGTERM)
            ends = [stream.result() for stream in streams]
        assert any('"finish_reason":"abort"' in end for end in ends), [end[-300:] for end in ends]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(90)
    leftovers = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"stray replica processes: {leftovers}"
