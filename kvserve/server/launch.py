"""``kvserve serve``: flags -> EngineConfig, then uvicorn with a model that loads behind a 503 /health and a
SIGTERM that drains.

Life of the process::

    bind socket -> uvicorn starts (health 503) -> engine loads in a thread -> startup line, health 200
    SIGTERM -> health 503, new requests 503 -> in-flight requests finish (up to --shutdown-timeout)
            -> the rest are aborted -> uvicorn closes connections -> engine thread joined -> exit 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI

from kvserve.config import EngineConfig
from kvserve.host_limits import fit_threads_to_cpu_quota, warn_if_cpus_are_busy
from kvserve.logs import configure_logging, uvicorn_logging
from kvserve.server.app import build_app
from kvserve.server.environment import warn_of_vllm_environment
from kvserve.server.sockets import UVICORN_PROTOCOLS, http_url, raise_open_file_limit, serving_socket
from kvserve.server.state import ServerSettings, ServerState

logger = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.05
CONNECTION_CLOSE_SECONDS = 5.0  # after the drain: how long uvicorn waits for responses still being written
# What a model that fails to load raises for a bad model, path or flag (CheckpointError, ModelNotFoundError,
# UnsupportedModelError, a limit out of range): the user's to fix, and said in one line
USER_ERRORS = (ValueError, FileNotFoundError)


def serve(args: argparse.Namespace, config: EngineConfig, settings: ServerSettings) -> int:
    """Run the server (``cli_serve``'s ``engine_config`` and ``server_settings`` of the flags) until SIGTERM /
    SIGINT; 0 after a clean drain, 1 if the model failed to load."""
    configure_logging(args.log_level)
    warn_of_vllm_environment()
    fit_threads_to_cpu_quota()
    warn_if_cpus_are_busy()
    state = ServerState(settings)
    sock = serving_socket(args.host, args.port)
    raise_open_file_limit()
    url = http_url(*sock.getsockname()[:2])
    logger.info("loading %s; listening on %s (/health answers 503 until it is loaded)", args.model, url)
    server = DrainingServer(state, uvicorn.Config(
        build_app(state, _lifespan(state, config, url)), timeout_graceful_shutdown=CONNECTION_CLOSE_SECONDS,
        **uvicorn_logging(args.log_level, access_log=not args.disable_uvicorn_access_log), **UVICORN_PROTOCOLS,
    ))
    server.run(sockets=[sock])
    if state.load_error is not None:
        print(f"kvserve: error: could not load {args.model}: {state.load_error}", file=sys.stderr, flush=True)
        return 1
    if state.failure is not None:
        print(f"kvserve: error: the engine failed while serving: {state.failure!r}", file=sys.stderr, flush=True)
        return 1
    return 0


def _lifespan(state: ServerState, config: EngineConfig, url: str):
    """Load the engine in a thread (so /health can answer 503 meanwhile); shut it down when uvicorn stops."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = threading.Thread(target=load_engine, args=(state, config, url), name="kvserve-loader", daemon=True)
        loader.start()
        try:
            yield
        finally:
            if state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)

    return lifespan


def load_engine(state: ServerState, config: EngineConfig, url: str) -> None:
    """Build the engine into ``state`` (its metrics, its limits) and start its loop; a failure is kept in
    ``state.load_error``, not raised. ``url`` is where it is served, for the start-up line."""
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.server.metrics import ServerMetrics

    try:
        started = time.monotonic()
        engine = LLMEngine(config)
        for adapter in state.settings.lora_modules:  # each read and checked now: a bad one stops the start-up
            engine.lora_adapters.resolve(adapter)
        engine.warm_up()  # before the metrics' counters start: its step is not a client's
        stats = engine.stats()
        state.metrics = ServerMetrics(state.settings.model_name, stats, engine.max_model_len)
        state.max_model_len = engine.max_model_len
        async_engine = AsyncEngine(engine, observer=state.metrics)
        state.metrics.count_waiting(async_engine.num_waiting)
        async_engine.start()
        state.engine = async_engine
    except Exception as e:  # reported by serve(), which exits 1
        if not isinstance(e, USER_ERRORS):  # a user's mistake is told in serve()'s one line; a bug keeps its trace
            logger.exception("loading the model failed")
        state.load_error = e  # DrainingServer.on_tick sees it and stops
        return
    logger.info("serving %s as %r at %s/v1, max_model_len %d (loaded in %.1f s)", state.settings.model_root,
                ", ".join(state.settings.served_model_names), url, engine.max_model_len, time.monotonic() - started)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM / SIGINT drains instead of stopping, and the process exits 0.

    Draining: health turns 503 and new requests get 503, in-flight requests may finish for
    ``shutdown_timeout`` seconds, the rest are aborted, then uvicorn's own shutdown runs. A second signal ends
    the grace period at once: the requests still running are aborted (each stream ends with ``finish_reason``
    abort and ``[DONE]``), then the server stops. A third stops without waiting for anything.
    """

    def __init__(self, state: ServerState, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurried = False  # a second signal came: abort what still runs now

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        failed = self.state.load_error is not None or self.state.failure is not None
        return failed or await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise the signal at exit, and we exit 0.
        if self.state.engine is None or self._loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
            return
        if self.state.draining:
            if self._hurried:
                self.force_exit = self.should_exit = True
            else:
                logger.info("received %s again: aborting the requests still running", signal.Signals(sig).name)
                self._hurried = True
            return
        logger.info("received %s: draining for up to %.0f s", signal.Signals(sig).name,
                    self.state.settings.shutdown_timeout)
        self.state.draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        engine = self.state.engine
        assert engine is not None
        deadline = time.monotonic() + self.state.settings.shutdown_timeout
        while engine.num_unfinished() and time.monotonic() < deadline and not self._hurried:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if engine.num_unfinished():
            logger.warning("aborting %d requests still running %s", engine.num_unfinished(),
                           "on a second signal" if self._hurried else "after the grace period")
            engine.abort_all()
            while engine.num_unfinished() and engine.is_running:
                await asyncio.sleep(DRAIN_POLL_SECONDS)
        self.should_exit = True
