"""Tensor parallelism across processes: the process group, the worker processes and what rank 0 tells them.

The scheduler, the KV manager and the sampler stay in rank 0, the engine's process; ranks 1 .. N-1 are worker
processes that each hold a ``ModelRunner`` over their part of the weights and of the KV pool: spawned on this
machine (``start_workers``, ``--distributed-executor-backend mp``) or Ray actors (``ray_workers.py``, ``ray``),
driven alike once started (``form_group``; ``WorkerHandle`` is what differs)::

    rank 0: ModelRunner.execute(sched_out)           rank r: worker_main's loop
      WorkerGroup.broadcast_step  ---- pipe ---->     SchedulerOutput -> ModelRunner.execute(sched_out)
      forward: embeddings, one all-reduce per attention and per MLP block, LM head gathered to rank 0
                                 <--- gloo (CPU) / NCCL (CUDA) --->
      sample; WorkerGroup.share_sampled -- pipe -->   DriverLink.share_sampled: the tokens its batch appends
    between steps:
      WorkerGroup.add_lora / remove_lora -- pipe -->  AddLoRA / RemoveLoRA -> ModelRunner.add_lora / remove_lora

Only rank 0 samples (grammar, penalties, seeds and logprobs live there); each worker appends the token ids rank 0
sends it right after sampling, so its persistent batch stays in step. Steps and tokens travel over one pipe per
worker (an authenticated TCP connection to a Ray actor: the same ``Connection``), not a collective: a worker waits
for the next step as long as the server idles (a collective would time out) and sees rank 0's exit as the pipe's
end. LoRA adapters are installed and removed through the same pipe (rank 0 read the adapter and installed its
part first; each worker cuts its own part as it installs): the engine thread sends them between steps, so every
rank's model holds the same adapters at every step. The model's collectives run on a process group of their own
(``TensorParallel``; no global default group), with ``COLLECTIVE_TIMEOUT`` on each, start-up included.

Failures end in a ``TensorParallelError`` naming the worker, never a hang: rank 0 checks that every worker is
alive before each step, turns a failed collective (a dead peer closes its connection) into that error, shuts the
others down, and refuses further steps. A worker whose start-up fails sends its error before it exits; one that
loses rank 0 exits. Workers are daemon processes (Ray actors are owned by rank 0's process): they also end with
rank 0's interpreter.

Not combined with tensor parallelism yet: what ``EngineConfig._check_tensor_parallel`` refuses by name (quantized
weights, int8 activations, weight offload, the KV tiers, draft speculation; ``quantization="auto"`` dequantizes a
GGUF, and says so in the log) and CPU step graphs (every step runs eagerly, logged once). Every rank builds its
runner from rank 0's ``RunnerOptions``.

On CPU the cores are split: every rank runs ``max(1, threads // N)`` torch threads, rank 0 included (its own
count is lowered until the workers are closed), so N ranks on few cores do not oversubscribe them.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.kv.groups import KVCacheGroups
from kvserve.model.layers.tensor_parallel import TensorParallel
from kvserve.model.loader import load_checkpoint
from kvserve.model.lora_adapter import LoRAAdapter
from kvserve.model.sources import ModelLocation
from kvserve.sched.output import SchedulerOutput
from kvserve.worker.model_runner import ModelRunner, RunnerOptions
from kvserve.worker.peers import StepPeers

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)  # every collective, the group's rendezvous included
LOAD_TIMEOUT_SECONDS = 600.0  # a worker's checkpoint load and KV allocation (a dead worker is noticed at once)
SHUTDOWN_SECONDS = 5.0  # a worker's time to exit on Shutdown before it is killed
FAILURE_GRACE_SECONDS = 1.0  # after a failed step, how long to look for the worker that caused it
_POLL_SECONDS = 0.05
LOOPBACK = "127.0.0.1"  # where local workers meet rank 0 (Ray's meet at the driver's node address)


class TensorParallelError(RuntimeError):
    """A worker died, failed or did not answer: the message names it. The engine cannot step any more."""


# ---- messages over a worker's pipe ---------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its runner, besides its rank."""

    location: ModelLocation
    dtype: torch.dtype
    device_type: str
    options: RunnerOptions  # rank 0's
    num_threads: int
    load_format: str = "auto"  # "dummy": each rank draws random weights for its part


@dataclass(frozen=True)
class InitKV:
    """Rank 0 -> worker: allocate the KV pool (as many blocks as rank 0's) and the persistent batch, laid out in
    rank 0's KV cache groups (``kv/groups.py``; None: the plain layout, which a runner starts with)."""

    num_blocks: int
    max_model_len: int
    groups: KVCacheGroups | None = None


@dataclass(frozen=True)
class Sampled:
    """Rank 0 -> worker: the tokens the step appended to each request."""

    token_ids: dict[str, list[int]]


@dataclass(frozen=True)
class AddLoRA:
    """Rank 0 -> worker: install this LoRA adapter (rank 0's copy, read once: every rank serves the same content;
    each cuts its own part) under ``adapter_id``. Sent on the steps' pipe, so it lands between the same steps on
    every rank."""

    adapter_id: int
    adapter: LoRAAdapter


@dataclass(frozen=True)
class RemoveLoRA:
    """Rank 0 -> worker: take adapter ``adapter_id`` off the model."""

    adapter_id: int


@dataclass(frozen=True)
class Shutdown:
    """Rank 0 -> worker: exit."""


@dataclass(frozen=True)
class Ready:
    """Worker -> rank 0: the model is loaded (first), the KV pool allocated (after ``InitKV``)."""


@dataclass(frozen=True)
class Failed:
    """Worker -> rank 0: start-up or a step raised; the worker exits."""

    error: str


# ---- the workers, as rank 0 watches them ----------------------------------------------------------------


class WorkerHandle(Protocol):
    """A worker rank 0 watches: a local process (``LocalWorker``) or a Ray actor (``ray_workers.RayWorker``).
    ``name`` is how errors name it (``pid 1234``)."""

    name: str

    def is_alive(self) -> bool: ...

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for it to end."""

    def kill(self) -> None:
        """End it now, and wait until it has."""

    def end_reason(self) -> str:
        """How it ended (``exit code -9``); asked only once it is not alive."""


class LocalWorker:
    """A worker process spawned on this machine."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.name = f"pid {process.pid}"

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def end_reason(self) -> str:
        return f"exit code {self.process.exitcode}"


# ---- the other ranks, as a runner sees them ------------------------------------------------------------


class DriverLink(StepPeers):
    """A worker's view: rank 0 sends the steps (``worker_main`` receives them) and the sampled tokens."""

    is_driver = False

    def __init__(self, conn: Connection, tp: TensorParallel) -> None:
        self.conn, self.tp = conn, tp

    def share_sampled(self, token_ids: dict[str, list[int]] | None) -> dict[str, list[int]]:
        message = self.conn.recv()
        if isinstance(message, Shutdown):
            raise EOFError("rank 0 shut the workers down in the middle of a step")
        assert isinstance(message, Sampled), f"expected the step's sampled tokens, got {type(message).__name__}"
        return message.token_ids


def _nothing() -> None:
    pass


class WorkerGroup(StepPeers):
    """Rank 0's view: the workers, a connection to each (a pipe to a local process, authenticated TCP to a Ray
    actor: the same ``Connection``), and the process group they share."""

    def __init__(self, workers: list[WorkerHandle], conns: list[Connection], num_threads_before: int,
                 release: Callable[[], None] = _nothing) -> None:
        self.workers, self.conns = workers, conns
        self._error: str | None = None
        # Shut down at close, or when the group is collected or the interpreter exits without one (an LLM
        # dropped unclosed): the workers stopped, rank 0's torch threads given back, and what else the workers
        # held (a Ray placement group, whose CPUs the next group would wait for) released
        self._shut_down = weakref.finalize(self, _shut_down, workers, conns, num_threads_before, release)

    def broadcast_step(self, sched_out: SchedulerOutput) -> None:
        self.check_alive()
        self._send_all(pickle.dumps(sched_out, protocol=pickle.HIGHEST_PROTOCOL))

    def share_sampled(self, token_ids: dict[str, list[int]] | None) -> dict[str, list[int]]:
        assert token_ids is not None
        self._send_all(pickle.dumps(Sampled(token_ids), protocol=pickle.HIGHEST_PROTOCOL))
        return token_ids

    def add_lora(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        self._send_between_steps(AddLoRA(adapter_id, adapter))

    def remove_lora(self, adapter_id: int) -> None:
        self._send_between_steps(RemoveLoRA(adapter_id))

    def _send_between_steps(self, message: AddLoRA | RemoveLoRA) -> None:
        """Send ``message`` to every worker, which handles it before the next step (a dead worker named)."""
        with self.stepping():
            self.check_alive()
            self._send_all(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def init_kv_cache(self, num_blocks: int, max_model_len: int, groups: KVCacheGroups | None = None) -> None:
        with self.stepping():
            self._expect_ready("load the model")
            self._send_all(pickle.dumps(InitKV(num_blocks, max_model_len, groups)))
            self._expect_ready("allocate its KV cache")

    @contextmanager
    def stepping(self) -> Iterator[None]:
        if self._error is not None:
            raise TensorParallelError(f"tensor parallelism stopped after an earlier failure: {self._error}")
        try:
            yield
        except BaseException as error:
            failure = self._wait_for_failure(FAILURE_GRACE_SECONDS)
            if failure is None and _timed_out(error):  # every worker runs: one stopped answering
                failure = (f"a collective with the tensor-parallel workers timed out after "
                           f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s while every worker still runs: one is "
                           f"stalled ({type(error).__name__}: {error})")
            self._error = failure or f"{type(error).__name__}: {error}"
            self.close()
            if failure is None or isinstance(error, TensorParallelError):
                raise
            raise TensorParallelError(failure) from error

    def close(self) -> None:
        self._shut_down()
        self._error = self._error or "the workers were shut down"

    def _send_all(self, data: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(data)

    def check_alive(self) -> None:
        failure = self._describe_failure()
        if failure is not None:
            raise TensorParallelError(failure)

    def _describe_failure(self) -> str | None:
        """What went wrong with the first worker that died or reported a failure, if any did."""
        for rank, (worker, conn) in enumerate(zip(self.workers, self.conns), start=1):
            reported = _pending_failure(conn)
            if reported is not None:
                return f"worker rank {rank} ({worker.name}) failed: {reported}"
            if not worker.is_alive():
                return f"worker rank {rank} ({worker.name}) died ({worker.end_reason()})"
        return None

    def _wait_for_failure(self, seconds: float) -> str | None:
        """A failed collective may be seen before its dead peer has finished exiting: look for a while."""
        deadline = time.monotonic() + seconds
        while (failure := self._describe_failure()) is None and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        return failure

    def _expect_ready(self, what: str) -> None:
        """Wait for every worker's Ready (in any order), or raise naming the first that failed, died or timed out."""
        deadline = time.monotonic() + LOAD_TIMEOUT_SECONDS
        waiting = {conn: rank for rank, conn in enumerate(self.conns, start=1)}
        while waiting:
            for conn in wait(list(waiting), _POLL_SECONDS):
                rank = waiting.pop(conn)
                worker = self.workers[rank - 1]
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # it exited without a word
                    worker.join(SHUTDOWN_SECONDS)
                    message = Failed(f"it died ({worker.end_reason()})")
                if isinstance(message, Failed):
                    raise TensorParallelError(f"worker rank {rank} ({worker.name}) failed to {what}: "
                                              f"{message.error}")
            if waiting and time.monotonic() > deadline:
                rank = min(waiting.values())
                raise TensorParallelError(f"worker rank {rank} ({self.workers[rank - 1].name}) did not {what} "
                                          f"within {LOAD_TIMEOUT_SECONDS:.0f} s")


def _pending_failure(conn: Connection) -> str | None:
    try:
        if conn.poll(0):
            message = conn.recv()
            return message.error if isinstance(message, Failed) else None
    except (EOFError, OSError):
        return None
    return None


# ---- start-up --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """Where a worker runs on its node: the address its gloo connections use, and its CUDA device's index."""

    host: str
    cuda_index: int


Launch = Callable[[tuple[str, int]], tuple[list[WorkerHandle], list[Connection]]]


def start_workers(spec: WorkerSpec, size: int) -> WorkerGroup:
    """Spawn ranks 1 .. ``size`` - 1 on this machine and join them in a process group (gloo on CPU, NCCL on
    CUDA): see ``form_group``."""
    if spec.device_type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices, found {torch.cuda.device_count()}")

    def spawn(store_address: tuple[str, int]) -> tuple[list[WorkerHandle], list[Connection]]:
        context = mp.get_context("spawn")
        workers: list[WorkerHandle] = []
        conns = []
        for rank in range(1, size):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=worker_main, daemon=True, name=f"kvserve-tp-rank{rank}",
                                      args=(rank, size, store_address, spec, child_end, Place(LOOPBACK, rank)))
            process.start()
            child_end.close()
            workers.append(LocalWorker(process))
            conns.append(parent_end)
        return workers, conns

    return form_group(spec, size, LOOPBACK, spawn)


def form_group(spec: WorkerSpec, size: int, host: str, launch: Launch,
               release: Callable[[], None] = _nothing) -> WorkerGroup:
    """Split the CPU threads (rank 0's own count included), open rank 0's store at ``host`` on a free port, have
    ``launch`` start ranks 1 .. ``size`` - 1 (given the store's address) and join rank 0 to their process group;
    ``release`` runs once the workers are stopped. The workers load their models meanwhile; the first
    ``init_kv_cache`` waits for them. Raises ``TensorParallelError`` (workers stopped) on failure."""
    num_threads_before = torch.get_num_threads()
    if spec.device_type == "cpu":
        torch.set_num_threads(spec.num_threads)
        logger.info("tensor parallel: %d ranks, %d CPU threads each", size, spec.num_threads)
    try:
        store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        workers, conns = launch((host, store.port))
    except BaseException:
        torch.set_num_threads(num_threads_before)
        release()
        raise
    group = WorkerGroup(workers, conns, num_threads_before, release)
    with group.stepping():
        _wait_for_arrivals(store, group, size)
        group.tp = join_group(0, size, store, spec.device_type, host)
    return group


def _arrival_key(rank: int) -> str:
    return f"kvserve-tp-arrived/{rank}"


def _wait_for_arrivals(store: dist.Store, group: WorkerGroup, size: int) -> None:
    """Wait until every worker has come as far as joining the group (each sets its arrival key first), watching
    them meanwhile: the group's rendezvous would wait the whole collective timeout for a worker that died on the
    way (an import that failed, the OOM killer), where this names it at once."""
    keys = [_arrival_key(rank) for rank in range(1, size)]
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while not store.check(keys):
        group.check_alive()
        if time.monotonic() > deadline:
            missing = [rank for rank in range(1, size) if not store.check([_arrival_key(rank)])]
            raise TensorParallelError(f"worker rank {missing[0]} did not reach the process group within "
                                      f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s")
        time.sleep(_POLL_SECONDS)


def join_group(rank: int, size: int, store: dist.Store, device_type: str, host: str) -> TensorParallel:
    """This rank's ``TensorParallel`` on a process group of its own over ``store`` (blocks until all join);
    on CPU its gloo connections use ``host``, this rank's own address (not a guess from the host name)."""
    prefixed = dist.PrefixStore("kvserve-tp", store)
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return TensorParallel(rank, size, dist.ProcessGroupNCCL(prefixed, rank, size, options))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = COLLECTIVE_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return TensorParallel(rank, size, dist.ProcessGroupGloo(prefixed, rank, size, options))


def worker_main(rank: int, size: int, store_address: tuple[str, int], spec: WorkerSpec, conn: Connection,
                place: Place) -> None:
    """A worker (a spawned process, or a Ray actor's task): join the group through rank 0's store at
    ``store_address``, build the runner for rank ``rank``, report Ready, then run each step rank 0 sends until
    Shutdown or until rank 0 is gone. An exception is reported to rank 0, then raised."""
    try:
        torch.set_num_threads(spec.num_threads)
        device = torch.device("cuda", place.cuda_index) if spec.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        host, port = store_address
        store = dist.TCPStore(host, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        store.set(_arrival_key(rank), b"")
        link = DriverLink(conn, join_group(rank, size, store, spec.device_type, place.host))
        checkpoint = load_checkpoint(spec.location, spec.dtype, spec.load_format)
        runner = ModelRunner(checkpoint, spec.dtype, device, spec.options, peers=link)
        conn.send(Ready())
        _serve(runner, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # rank 0 is gone: nothing to report to
    except BaseException as error:
        try:
            conn.send(Failed(f"{type(error).__name__}: {error}"))
        except OSError:
            pass
        raise


def _serve(runner: ModelRunner, conn: Connection) -> None:
    while True:
        message = conn.recv()
        if isinstance(message, Shutdown):
            return
        if isinstance(message, InitKV):
            if message.groups is not None:
                runner.use_kv_groups(message.groups)
            runner.init_kv_cache(message.num_blocks, message.max_model_len)
            conn.send(Ready())
        elif isinstance(message, AddLoRA):
            runner.add_lora(message.adapter_id, message.adapter)
        elif isinstance(message, RemoveLoRA):
            runner.remove_lora(message.adapter_id)
        else:
            runner.execute(message)


def _shut_down(workers: list[WorkerHandle], conns: list[Connection], num_threads_before: int,
               release: Callable[[], None]) -> None:
    """Ask each worker to stop, kill those that do not within ``SHUTDOWN_SECONDS``, close the connections,
    release what else they held and give rank 0 its threads back (``conns`` emptied: a group stops once)."""
    for conn in conns:
        try:
            conn.send(Shutdown())
        except OSError:
            pass  # that worker is gone already
    deadline = time.monotonic() + SHUTDOWN_SECONDS
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
    for conn in conns:
        conn.close()
    conns.clear()
    release()
    torch.set_num_threads(num_threads_before)


def _timed_out(error: BaseException) -> bool:
    """Whether a step failed on a collective's timeout (gloo's and NCCL's say so in their message)."""
    return isinstance(error, RuntimeError) and "timed out" in str(error).lower()
