"""``kvserve router`` starts without the engine: the CLI hands ``router`` to its own parser before building the
one that imports torch and transformers, so the router process never loads them (layer rule: router -> server
for the error shape only)."""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvserve.cli import main
from kvserve.router.launch import add_data_parallel_arguments, add_router_arguments, build_router, replica_command
from kvserve.router.upstream import DEFAULT_RESPONSE_TIMEOUT_S
from kvserve.server.sockets import http_url
from kvserve.server.state import DEFAULT_MAX_BODY_BYTES

ROOT = Path(__file__).resolve().parents[2]
ENGINE_MODULES = ("torch", "transformers", "kvserve.engine", "kvserve.config", "kvserve.model", "kvserve.worker")

STARTS_THE_ROUTER = f"""
import sys
import uvicorn

def run(server, sockets=None):  # the app is built and about to be served: what has been imported by now
    print(" ".join(m for m in {ENGINE_MODULES!r} if m in sys.modules) or "none")

uvicorn.Server.run = run
from kvserve.cli import main
from kvserve.router.launch import add_data_parallel_arguments, add_router_arguments, build_router
from kvserve.router.upstream import DEFAULT_RESPONSE_TIMEOUT_S
from kvserve.server.sockets import http_url
from kvserve.server.state import DEFAULT_MAX_BODY_BYTES
sys.exit(main(["router", "--worker", "http://127.0.0.1:9", "--worker", "http://127.0.0.1:10", "--port", "0",
               "--routing-policy", "round_robin"]))
"""


def test_starting_the_router_imports_neither_torch_nor_transformers() -> None:
    done = subprocess.run([sys.executable, "-c", STARTS_THE_ROUTER], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "none"


def test_router_help_imports_neither_and_lists_every_flag() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvserve.cli", "router", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers"}
    for flag in ("--worker", "--host", "--port", "--routing-policy", "cache_aware,round_robin,least_load",
                 "--max-body-bytes", "--upstream-timeout"):
        assert flag in done.stdout


def test_the_full_parser_still_lists_the_router() -> None:
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "router" in done.stdout


def test_a_worker_url_without_a_scheme_is_a_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--worker", "localhost:8001"]) == 2
    assert "kvserve: error: a replica URL must be http://HOST[:PORT]" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl")
def test_replica_processes_end_with_a_router_killed_on_the_spot() -> None:
    """A router killed with SIGKILL runs no cleanup: its replicas end through the parent-death signal."""
    router = subprocess.Popen([sys.executable, "-c", """
import subprocess, sys, time
from kvserve.router.child_process import die_with_parent  # what LocalReplicas starts each replica with
replica = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=die_with_parent)
print(replica.pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    replica_pid = int(router.stdout.readline())
    router.kill()
    router.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{replica_pid}").exists() and _state(replica_pid) != "Z":
        assert time.monotonic() < deadline, "the replica outlived its router"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_router_binds_before_it_says_it_listens(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["router", "--worker", "http://127.0.0.1:9", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"kvserve: error: cannot listen on 127.0.0.1:{port}: " in err and "kvserve router on" not in err
    assert main(["router", "--worker", "http://127.0.0.1:9", "--host", "999.9.9.9"]) == 2
    assert "kvserve: error: cannot listen on 999.9.9.9:8000: " in capsys.readouterr().err


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_a_cli_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--worker", "http://127.0.0.1:9", "--port", port]) == 2
    assert capsys.readouterr().err == f"kvserve: error: --port must be in 0..65535, got {port}\n"


def test_urls_put_an_ipv6_host_in_brackets() -> None:
    assert http_url("::1", 8000) == "http://[::1]:8000"
    assert http_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"


STARTS_REPLICAS_THAT_EXIT = """
import argparse, sys
from kvserve.router.launch import serve_data_parallel
args = argparse.Namespace(data_parallel_size=2, data_parallel_backend="mp", port=int(sys.argv[1]), host="127.0.0.1",
                          routing_policy="round_robin", max_body_bytes=4096, upstream_timeout=600.0, api_key=None,
                          log_level="info", allowed_origins=["*"], allowed_methods=["*"], allowed_headers=["*"],
                          allow_credentials=False, shutdown_timeout=30.0)
sys.exit(serve_data_parallel(args, ["router"]))  # each replica: `kvserve router` without --worker, which exits 2
"""


def test_data_parallel_stops_once_every_replica_has_exited() -> None:
    """Replicas that cannot start (as with a model that cannot load) leave the router nothing to route to: it
    stops with an error instead of answering 503 forever."""
    with socket.socket() as probe:  # a free port, and the two after it most likely
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", STARTS_REPLICAS_THAT_EXIT, str(port)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "kvserve: error: every replica exited (exit codes 2, 2)" in done.stderr


def router_args(define: object, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    define(parser)
    return parser.parse_args(list(argv))


def test_the_body_limit_and_the_upstream_timeout_reach_the_router() -> None:
    given = router_args(add_router_arguments, "--worker", "http://a:1", "--max-body-bytes", "123",
                        "--upstream-timeout", "7.5", "--api-key", "sekret")
    router = build_router(given.worker, given)
    assert (router.max_body_bytes, router.upstream.response_timeout, router.api_keys) == (123, 7.5, ("sekret",))
    default = router_args(add_router_arguments, "--worker", "http://a:1")
    router = build_router(default.worker, default)
    assert (router.max_body_bytes, router.upstream.response_timeout) == (DEFAULT_MAX_BODY_BYTES,
                                                                          DEFAULT_RESPONSE_TIMEOUT_S)
    assert router_args(add_data_parallel_arguments, "--upstream-timeout", "30").upstream_timeout == 30.0


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "soon"])
def test_an_upstream_timeout_that_is_no_positive_number_is_a_cli_error(seconds: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["router", "--worker", "http://127.0.0.1:9", "--upstream-timeout", seconds])
    assert f"--upstream-timeout: must be a number of seconds > 0, got {seconds}" in capsys.readouterr().err


def test_the_api_key_reaches_the_replicas_in_their_environment_not_their_command_line(monkeypatch,
                                                                                      tmp_path: Path) -> None:
    """A command line is what `ps` shows every user of the machine."""
    from tests.cgroups import fake_cgroups

    fake_cgroups(monkeypatch, tmp_path)  # no CPU quota to share out
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key", nargs="+", default=None)
    add_data_parallel_arguments(parser)
    argv = ["serve", "m", "--api-key", "sekret", "--data-parallel-size", "2", "--max-num-seqs", "4"]
    args = parser.parse_known_args(argv)[0]
    assert replica_command(args, argv) == (["serve", "m", "--max-num-seqs", "4"],
                                           {"KVSERVE_API_KEY": "sekret", "KVSERVE_LOCAL_REPLICAS": "2"})
    argv = ["serve", "--api-key=first", "--api-key", "old", "new", "--", "m"]  # every key, none in the command
    args = parser.parse_known_args(argv)[0]
    assert replica_command(args, argv)[0] == ["serve", "--", "m"]
    assert replica_command(args, argv)[1]["KVSERVE_API_KEY"] == "old\nnew"
    argv = ["serve", "--api-key", "old", "new", "--max-num-seqs", "4", "m"]
    args = parser.parse_known_args(argv)[0]
    assert replica_command(args, argv)[0] == ["serve", "--max-num-seqs", "4", "m"]
    assert replica_command(args, argv)[1]["KVSERVE_API_KEY"] == "old\nnew"
    argv = ["serve", "m", "--api-key", "-12345", "-", "-1.5", "--max-num-seqs", "4"]  # argparse's values, all
    args = parser.parse_known_args(argv)[0]
    assert replica_command(args, argv)[0] == ["serve", "m", "--max-num-seqs", "4"]
    assert replica_command(args, argv)[1]["KVSERVE_API_KEY"] == "-12345\n-\n-1.5"
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert replica_command(parser.parse_known_args(["serve", "m"])[0], ["serve", "m"])[1] == {
        "KVSERVE_API_KEY": "from-env", "KVSERVE_LOCAL_REPLICAS": "1"}
    monkeypatch.delenv("KVSERVE_API_KEY")
    assert replica_command(parser.parse_known_args(["serve", "m"])[0], ["serve", "m"])[1] == {
        "KVSERVE_LOCAL_REPLICAS": "1"}


def test_the_router_takes_a_log_level_as_serve_does(capsys: pytest.CaptureFixture[str]) -> None:
    """It logged at INFO whatever was asked, and under `serve --data-parallel-size` not at all."""
    with pytest.raises(SystemExit) as exited:
        main(["router", "--worker", "http://127.0.0.1:9", "--log-level", "loud"])
    assert exited.value.code == 2 and "--log-level: invalid choice: 'loud'" in capsys.readouterr().err


def test_the_routers_cors_flags_are_vllms_and_a_preflight_needs_no_key() -> None:
    from kvserve.router.app import Router
    from kvserve.router.launch import router_app
    from kvserve.router.policy import make_policy
    from kvserve.server.cors import CorsPolicy

    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    args = parser.parse_args(["--worker", "http://127.0.0.1:9", "--allowed-origins", '["https://chat.example"]'])
    policy = CorsPolicy.from_cli_args(args)
    assert policy == CorsPolicy(allowed_origins=("https://chat.example",))
    router = Router(["http://127.0.0.1:9"], make_policy("round_robin"), api_keys=("sesame",))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(router_app(router, policy)), base_url="http://r")
    preflight = asyncio.run(client.options("/v1/completions", headers={
        "Origin": "https://chat.example", "Access-Control-Request-Method": "POST"}))
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://chat.example"


@pytest.mark.parametrize("value", ["*", '{"a": 1}', "[1]"])
def test_a_cors_list_that_is_no_json_array_of_strings_is_a_usage_error(value: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["router", "--worker", "http://127.0.0.1:9", "--allowed-origins", value])
    assert exited.value.code == 2 and "--allowed-origins: " in capsys.readouterr().err


def test_a_replicas_port_in_use_stops_the_deployment_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Each replica bound its port as it started: whatever else listened there became a replica to the router,
    which sent it half of the requests."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "/no/model", "--data-parallel-size", "2", "--port", str(port - 1)]) == 2
    err = capsys.readouterr().err
    assert f"kvserve: error: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "kvserve router on" not in err


def test_a_replicas_own_flags_go_before_any_double_dash_of_the_users() -> None:
    """`serve --served-model-name a b -- MODEL --data-parallel-size 2`: the replica's `--port N`, appended, was
    taken for a second MODEL after the `--`, and every replica refused its arguments."""
    from kvserve.cli import build_parser
    from kvserve.router.child_process import serve_command

    command = serve_command(["serve", "--served-model-name", "a", "b", "--", "/my/model"], "--port", "9001")
    args = build_parser("serve").parse_args(command[3:])
    assert (args.model, args.served_model_name, args.port) == ("/my/model", ["a", "b"], 9001)
