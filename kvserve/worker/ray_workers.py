"""Tensor-parallel ranks 1 .. N-1 as Ray actors: ``--distributed-executor-backend ray``.

Rank 0 stays in the engine's process, as with local workers; only where the other ranks run and how rank 0 reaches
them change. Everything after start-up is ``worker/parallel.py``'s: each actor runs ``worker_main`` (its runner,
its loop), and rank 0 drives them through the same ``WorkerGroup``, over one authenticated TCP connection per
actor instead of a pipe (both are a ``multiprocessing.connection.Connection``), so steps and sampled tokens travel
exactly as they do to local workers and a step costs no Ray call::

    driver (rank 0)                                   Ray actor (rank r), in bundle r of the placement group
      placement group: one bundle per rank, STRICT_PACK, bundle 0 on this node (rank 0 runs here)
      actor.address()  ------------------------->     Listener on its node's address (a free port)
      actor.run(...)   ------------------------->     accept, then worker_main: TCPStore at the driver's node
      Client(address, authkey)  <--- TCP --->         address, gloo / NCCL group, ModelRunner, steps
      WorkerGroup: steps, tokens, Shutdown over these connections; RayWorker watches the actor

Ray is used for placement and lifetimes: it places the bundles (on CUDA each asks for one GPU, and rank 0 runs
on the GPU Ray reserved in its bundle, so no actor is given it too), starts the actors and reports their deaths
(an actor's ``run`` ends with its loop: an error, or a kill). Failures are ``TensorParallelError``s naming the
rank: a group Ray cannot place within ``PLACEMENT_TIMEOUT_SECONDS``, an actor that does not start within
``START_TIMEOUT_SECONDS`` or cannot be reached, and, through ``WorkerGroup``, one that fails or dies later. Closing
the group stops the actors' loops, kills the actors and removes the placement group. A process that already runs
in a placement group (a Ray Serve replica, whose bundles ``kvserve.ray`` reserves per rank) places its ranks in
that group's bundles instead of reserving a second one. Actors are owned by this process: Ray ends them with it.

Ray is an optional dependency (``pip install 'kvserve[ray]'``), imported only when this backend starts. A Ray
already initialised by the caller (``ray.init(address=...)``) is used as it is; otherwise ``ray.init()`` joins
the cluster ``RAY_ADDRESS`` names, or starts a local one.
"""

from __future__ import annotations

import logging
import os
import secrets
from multiprocessing.connection import Client, Connection, Listener
from types import ModuleType
from typing import Any

import torch

from kvserve.extras import require_ray
from kvserve.worker.parallel import (
    SHUTDOWN_SECONDS,
    Place,
    TensorParallelError,
    WorkerGroup,
    WorkerHandle,
    WorkerSpec,
    form_group,
    worker_main,
)

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGY = "STRICT_PACK"  # a tensor-parallel group's collectives run every layer: keep it on one node
PLACEMENT_TIMEOUT_SECONDS = 60.0  # Ray placing the group's bundles (a cluster too small never does)
START_TIMEOUT_SECONDS = 120.0  # an actor's process up and listening (its model loads later, under LOAD_TIMEOUT)


class TensorParallelActor:
    """An actor's body (``ray.remote`` wraps it at start): a listener for rank 0's connection, then the worker
    loop. The listener authenticates rank 0 by ``authkey``, as steps arrive pickled."""

    def __init__(self, authkey: bytes) -> None:
        import ray

        self.host = ray.util.get_node_ip_address()
        self.listener = Listener((self.host, 0), authkey=authkey)

    def address(self) -> tuple[tuple[str, int], int]:
        """Where rank 0 connects, and this actor's pid (for errors)."""
        return self.listener.address, os.getpid()

    def run(self, rank: int, size: int, store_address: tuple[str, int], spec: WorkerSpec) -> None:
        """The worker's whole life: ends when rank 0 shuts it down or is gone; raises what the worker raised."""
        with self.listener:
            conn = self.listener.accept()
        with conn:
            # Ray shows an actor only the GPU of its bundle, as device 0
            worker_main(rank, size, store_address, spec, conn, Place(self.host, cuda_index=0))


class RayWorker:
    """A ``WorkerHandle`` over an actor: alive while its ``run`` task is (it ends with the loop, or with the
    actor's death)."""

    def __init__(self, ray: ModuleType, actor: Any, run: Any, name: str) -> None:
        self._ray, self.actor, self.run, self.name = ray, actor, run, name

    def is_alive(self) -> bool:
        ready, _ = self._ray.wait([self.run], timeout=0)
        return not ready

    def join(self, timeout: float) -> None:
        self._ray.wait([self.run], timeout=timeout)

    def kill(self) -> None:
        self._ray.kill(self.actor)
        self.join(SHUTDOWN_SECONDS)

    def end_reason(self) -> str:
        try:
            self._ray.get(self.run, timeout=0)
        except Exception as error:  # Ray's error for a dead actor, or the worker's own wrapped by Ray
            return _last_line(error)
        return "its loop ended"


def start_ray_workers(spec: WorkerSpec, size: int, device: torch.device) -> WorkerGroup:
    """Place ranks 0 .. ``size`` - 1 on the Ray cluster (rank 0's bundle on this node, reserved for this
    process, which runs on ``device``), start ranks 1 .. ``size`` - 1 as actors and join them in a process group
    formed at this node's address (``form_group``). Raises ImportError without Ray, ``TensorParallelError``
    naming the rank (everything stopped and released) on failure."""
    ray = require_ray("--distributed-executor-backend ray")
    if not ray.is_initialized():
        ray.init()
    from ray.util.placement_group import remove_placement_group

    host = ray.util.get_node_ip_address()
    placement, inherited = _placement_group(ray, spec, size, host)
    actors: list[Any] = []  # filled by ``_spawn_actors`` as they start, so that ``release`` kills every one

    def release() -> None:
        for actor in actors:
            ray.kill(actor)
        if not inherited:  # an inherited group is its owner's (Ray Serve's) to remove
            remove_placement_group(placement)

    def launch(store_address: tuple[str, int]) -> tuple[list[WorkerHandle], list[Connection]]:
        if spec.device_type == "cuda" and not inherited:  # in an inherited group Ray gave this actor its GPU
            _use_rank_zero_gpu(ray, placement, device)
        return _spawn_actors(ray, placement, inherited, spec, size, store_address, actors)

    logger.info("tensor parallel: ranks 1 .. %d as Ray actors, the group formed at %s", size - 1, host)
    return form_group(spec, size, host, launch, release)


def _placement_group(ray: ModuleType, spec: WorkerSpec, size: int, host: str) -> tuple[Any, bool]:
    """The placement group the ranks run in, and whether it is inherited: the one this process already runs in
    (a Ray Serve replica's), if any, else one reserved here (``_place``)."""
    inherited = ray.util.get_current_placement_group()
    if inherited is not None:
        return _check_inherited(inherited, spec, size), True
    return _place(ray, spec, size, host), False


def _spawn_actors(ray: ModuleType, placement: Any, inherited: bool, spec: WorkerSpec, size: int,
                  store_address: tuple[str, int], actors: list[Any]) -> tuple[list[WorkerHandle], list[Connection]]:
    """Start ranks 1 .. ``size`` - 1 as actors in their bundles, appended to ``actors`` as each starts (the
    caller's ``release`` kills them on a failure), run each one's worker loop, and connect rank 0 to each."""
    authkey = secrets.token_bytes(32)
    actor_class = ray.remote(TensorParallelActor)
    for rank in range(1, size):
        resources = _rank_resources(placement, inherited, spec, rank)
        actors.append(actor_class.options(**resources, scheduling_strategy=_in_bundle(placement, rank))
                      .remote(authkey))
    addresses = _wait_started(ray, actors)
    workers: list[WorkerHandle] = []
    for rank, (actor, (address, pid)) in enumerate(zip(actors, addresses), start=1):
        run = actor.run.remote(rank, size, store_address, spec)
        workers.append(RayWorker(ray, actor, run, f"Ray actor on {address[0]}, pid {pid}"))
    return workers, [_connect(rank, worker, address, authkey)
                     for rank, (worker, (address, _)) in enumerate(zip(workers, addresses), start=1)]


def _cpus(spec: WorkerSpec) -> int:
    """A rank's CPUs: its share of the threads on CPU, one to drive its GPU on CUDA."""
    return spec.num_threads if spec.device_type == "cpu" else 1


def _place(ray: ModuleType, spec: WorkerSpec, size: int, host: str) -> Any:
    """A placement group of one bundle per rank, bundle 0 (rank 0, this process) pinned to this node; removed
    again and a ``TensorParallelError`` if Ray cannot place it in time."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle: dict[str, float] = {"CPU": _cpus(spec)}
    if spec.device_type == "cuda":
        bundle["GPU"] = 1
    bundles = [{**bundle, f"node:{host}": 0.001}] + [dict(bundle) for _ in range(size - 1)]
    placement = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
    ready, _ = ray.wait([placement.ready()], timeout=PLACEMENT_TIMEOUT_SECONDS)
    if not ready:
        remove_placement_group(placement)
        raise TensorParallelError(
            f"Ray could not place the tensor-parallel group within {PLACEMENT_TIMEOUT_SECONDS:.0f} s: {size} "
            f"bundles of {bundle}, {PLACEMENT_STRATEGY}, rank 0's on this node ({host}); the cluster has "
            f"{ray.available_resources()} available")
    return placement


def _check_inherited(placement: Any, spec: WorkerSpec, size: int) -> Any:
    """The placement group this process runs in (a Ray Serve replica's, reserved by ``kvserve.ray``), if it has a
    bundle for each rank: rank 0 is this process, in bundle 0, and rank r's actor takes bundle r whole. Reserving
    a second group for the ranks would hold the replica's resources twice (a cluster sized for the replicas then
    never places it). A ``TensorParallelError`` names a group that does not fit."""
    bundles = placement.bundle_specs
    gpuless = [index for index, bundle in enumerate(bundles[:size]) if bundle.get("GPU", 0) < 1]
    if len(bundles) < size or (spec.device_type == "cuda" and gpuless):
        raise TensorParallelError(
            f"this process runs in a Ray placement group of {len(bundles)} bundles ({bundles}); tensor parallelism "
            f"of {size} needs a bundle per rank{', each with a GPU' if spec.device_type == 'cuda' else ''}: "
            "reserve one bundle per rank, as kvserve.ray does")
    return placement


def _rank_resources(placement: Any, inherited: bool, spec: WorkerSpec, rank: int) -> dict[str, float]:
    """What rank ``rank``'s actor asks for: its bundle whole in an inherited group, else the bundle ``_place``
    reserved for it."""
    if inherited:
        bundle = placement.bundle_specs[rank]
        return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    return {"num_cpus": _cpus(spec), "num_gpus": 1 if spec.device_type == "cuda" else 0}


def _in_bundle(placement: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index)


def _use_rank_zero_gpu(ray: ModuleType, placement: Any, device: torch.device) -> None:
    """Run rank 0 on the GPU Ray reserved in bundle 0 (asked of a task in that bundle), so that no actor is given
    the GPU this process uses."""
    task = ray.remote(num_cpus=0, num_gpus=1)(_gpu_ids).options(scheduling_strategy=_in_bundle(placement, 0))
    (gpu_id,) = ray.get(task.remote(), timeout=START_TIMEOUT_SECONDS)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if str(gpu_id) not in ids:
        raise TensorParallelError(f"Ray reserved GPU {gpu_id} for rank 0, which this process cannot see "
                                  f"(CUDA_VISIBLE_DEVICES={visible})")
    index = ids.index(str(gpu_id))
    if device.index is not None and device.index != index:
        raise TensorParallelError(f"Ray reserved GPU {gpu_id} (cuda:{index} here) for rank 0, but device={device} "
                                  "was asked for: use device='cuda' and let Ray choose")
    torch.cuda.set_device(index)


def _gpu_ids() -> list[Any]:
    import ray

    return ray.get_gpu_ids()


def _wait_started(ray: ModuleType, actors: list[Any]) -> list[tuple[tuple[str, int], int]]:
    """Each actor's listening address and pid, or a ``TensorParallelError`` naming the first rank that failed
    or did not start in time."""
    calls = [actor.address.remote() for actor in actors]
    ray.wait(calls, num_returns=len(calls), timeout=START_TIMEOUT_SECONDS)
    addresses = []
    for rank, call in enumerate(calls, start=1):
        try:
            addresses.append(ray.get(call, timeout=0))
        except ray.exceptions.GetTimeoutError:
            raise TensorParallelError(f"worker rank {rank} (a Ray actor) did not start within "
                                      f"{START_TIMEOUT_SECONDS:.0f} s") from None
        except ray.exceptions.RayError as error:
            raise TensorParallelError(f"worker rank {rank} (a Ray actor) failed to start: "
                                      f"{_last_line(error)}") from error
    return addresses


def _connect(rank: int, worker: RayWorker, address: tuple[str, int], authkey: bytes) -> Connection:
    try:
        return Client(address, authkey=authkey)
    except (OSError, EOFError) as error:
        worker.join(SHUTDOWN_SECONDS)
        reason = worker.end_reason() if not worker.is_alive() else f"{type(error).__name__}: {error}"
        raise TensorParallelError(f"worker rank {rank} ({worker.name}) could not be reached at "
                                  f"{address[0]}:{address[1]}: {reason}") from error


def _last_line(error: BaseException) -> str:
    """Ray's errors end with the reason (``The actor is dead because it was killed by `ray.kill`.``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
