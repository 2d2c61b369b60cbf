"""``LoRAAdapters``: the LoRA adapters an engine serves, each read once and installed on the runner's model under its
``lora_int_id``, which requests then carry (``Request.lora_id``) with the adapter's content digest (their KV's
namespace, ``kv/block_keys.py``).

An adapter is installed as a request first names it (``resolve``), or read beforehand and installed by ``add`` (a
server reads it off the engine thread), and stays until ``remove``: its id is retired at once (a request naming it
is refused, and no other adapter may take it), and its weights leave the model once no unfinished request runs with
it (the scheduler's ``num_requests_by_adapter``), so that requests already running or waiting finish with it, as
vLLM's do. Its KV blocks in the prefix cache are then unreachable (keyed by its digest) and evicted as the pool needs
them; the same content loaded again under another id finds them. vLLM's eviction of adapters no request uses
(``max_cpu_loras``) is not built; ``max_loras`` bounds the adapters of one step (the scheduler's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from kvserve.config import LoRAConfig
from kvserve.lora_request import LoRARequest, RemovedLoRAAdapter
from kvserve.model.lora_adapter import LoRAAdapter, read_lora_adapter
from kvserve.sampling_params import InvalidParameter
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedAdapter:
    """An installed adapter: the request that named it first, its content digest and the bytes its weights take on
    the model."""

    request: LoRARequest
    digest: str
    num_bytes: int


class LoRAAdapters:
    def __init__(self, config: LoRAConfig, runner: ModelRunner, num_requests_by_adapter: Mapping[int, int]) -> None:
        """``num_requests_by_adapter``: the scheduler's live count of the unfinished requests of each adapter."""
        self.config = config
        self._runner = runner
        self._num_requests = num_requests_by_adapter
        self._installed: dict[int, ServedAdapter] = {}  # removed ones too, until their last request finishes
        self._removed: dict[int, str] = {}  # retired ids -> their adapter's name: never served again
        self._retiring: set[int] = set()  # removed, and installed while requests still run with them

    def resolve(self, lora_request: LoRARequest | None) -> ServedAdapter | None:
        """The adapter a request runs with, read and installed the first time its id comes; None for the base
        model. ``InvalidParameter`` where LoRA is off, the id names another adapter or was removed,
        ``LoRAAdapterError`` (naming the adapter and the field) where its files are not one kvserve serves."""
        if lora_request is None:
            return None
        self._check_request(lora_request)
        served = self._installed.get(lora_request.lora_int_id)
        if served is None:
            return self.add(lora_request, read_lora_adapter(lora_request.lora_path, lora_request.lora_name,
                                                            self.config.max_lora_rank))
        if served.request.lora_path != lora_request.lora_path:
            raise InvalidParameter("lora_request", f"lora_int_id {lora_request.lora_int_id} is adapter "
                                                   f"{served.request.lora_name!r} at {served.request.lora_path}, not "
                                                   f"{lora_request.lora_path}: one id names one adapter")
        return served

    def add(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> ServedAdapter:
        """Install ``adapter`` (read from ``lora_request``'s directory) under its id, logging the memory it takes;
        ``InvalidParameter`` where the id is served or was, ``LoRAAdapterError`` where it does not fit the model
        (nothing installed)."""
        self._check_request(lora_request)
        if lora_request.lora_int_id in self._installed:
            raise InvalidParameter("lora_int_id", f"lora_int_id {lora_request.lora_int_id} is already adapter "
                                                  f"{self._installed[lora_request.lora_int_id].request.lora_name!r}")
        self._runner.add_lora(lora_request.lora_int_id, adapter)
        served = ServedAdapter(lora_request, adapter.digest, self._runner.lora_bytes(lora_request.lora_int_id))
        self._installed[lora_request.lora_int_id] = served
        logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s: %.2f MB on the model", lora_request.lora_name,
                    lora_request.lora_int_id, adapter.rank, lora_request.lora_path, served.num_bytes / 2**20)
        return served

    def remove(self, lora_int_id: int) -> int:
        """Retire adapter ``lora_int_id``; its weights go now, or once the requests running or waiting with it
        (how many is returned) finish. ``InvalidParameter`` where no adapter of that id is served."""
        served = self._installed.get(lora_int_id)
        if served is None or lora_int_id in self._removed:
            raise InvalidParameter("lora_int_id", f"no LoRA adapter of lora_int_id {lora_int_id} is served")
        self._removed[lora_int_id] = served.request.lora_name
        num_requests = self._num_requests.get(lora_int_id, 0)
        if num_requests:
            self._retiring.add(lora_int_id)
            logger.info("LoRA adapter %r (id %d) removed; installed until its %d unfinished requests finish",
                        served.request.lora_name, lora_int_id, num_requests)
        else:
            self._uninstall(lora_int_id)
        return num_requests

    def drop_retired(self) -> None:
        """Uninstall the removed adapters whose last request has finished (called after steps and aborts)."""
        if not self._retiring:
            return
        for lora_int_id in [i for i in self._retiring if not self._num_requests.get(i)]:
            self._retiring.discard(lora_int_id)
            self._uninstall(lora_int_id)

    def name_of(self, lora_int_id: int) -> str:
        """The name of an installed adapter (one removed whose requests still run included)."""
        return self._installed[lora_int_id].request.lora_name

    @property
    def served(self) -> list[LoRARequest]:
        """The adapters served (installed and not removed), in the order they came."""
        return [served.request for i, served in self._installed.items() if i not in self._removed]

    def _check_request(self, lora_request: LoRARequest) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise InvalidParameter("lora_request", f"lora_request must be a LoRARequest, got "
                                                   f"{type(lora_request).__name__}")
        if not self.config.enable_lora:
            raise InvalidParameter("lora_request", f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is "
                                                   "off: start the engine with enable_lora=True (--enable-lora)")
        if lora_request.lora_int_id in self._removed:
            raise RemovedLoRAAdapter(lora_request, self._removed[lora_request.lora_int_id])

    def _uninstall(self, lora_int_id: int) -> None:
        served = self._installed.pop(lora_int_id)
        self._runner.remove_lora(lora_int_id)
        logger.info("LoRA adapter %r (id %d) unloaded: %.2f MB freed", served.request.lora_name, lora_int_id,
                    served.num_bytes / 2**20)
