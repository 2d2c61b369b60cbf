"""The other ranks as a ``ModelRunner`` sees them: the seam between a runner and tensor parallelism.

A runner alone holds the base, ``StepPeers``; under tensor parallelism rank 0 holds a ``WorkerGroup`` and each
worker a ``DriverLink`` (both in ``worker/parallel.py``, which builds runners and so imports this module, never
the other way round).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from kvserve.kv.groups import KVCacheGroups
from kvserve.model.lora_adapter import LoRAAdapter
from kvserve.model.layers.tensor_parallel import TensorParallel
from kvserve.sched.output import SchedulerOutput


class StepPeers:
    """The other ranks as a ``ModelRunner`` sees them. This base is a runner alone (no tensor parallelism):
    it samples, and there is no one to tell."""

    is_driver = True  # samples, and tells the others
    tp = TensorParallel()  # this rank among the ranks, for the model's layers

    def broadcast_step(self, sched_out: SchedulerOutput) -> None:
        """Rank 0: send the step to the workers before running it."""

    def share_sampled(self, token_ids: dict[str, list[int]] | None) -> dict[str, list[int]]:
        """Rank 0: send the step's sampled tokens and return them; a worker: receive them."""
        assert token_ids is not None
        return token_ids

    def add_lora(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Rank 0: have the workers install ``adapter`` (once rank 0 has: it fits the model) before the next step."""

    def remove_lora(self, adapter_id: int) -> None:
        """Rank 0: have the workers take adapter ``adapter_id`` off their layers before the next step."""

    def init_kv_cache(self, num_blocks: int, max_model_len: int, groups: KVCacheGroups | None = None) -> None:
        """Rank 0: have the workers allocate their KV pools, laid out in ``groups`` (after their models loaded)."""

    def stepping(self) -> AbstractContextManager[None]:
        """Around each step on rank 0: a failure becomes a ``TensorParallelError`` naming the worker."""
        return nullcontext()

    def close(self) -> None:
        """Stop the workers (idempotent)."""

    def check_alive(self) -> None:
        """Rank 0: raise ``TensorParallelError`` naming a worker that died or reported a failure."""
