"""``LoRAAdapters``: the LoRA adapters an engine serves, each read once and installed on the runner's model under its
``lora_int_id``, which requests then carry (``Request.lora_id``) with the adapter's content digest (their KV's
namespace, ``kv/block_keys.py``).

An adapter stays installed for the engine's life: vLLM's eviction of adapters no request uses
(``max_cpu_loras``) is not built; ``max_loras`` bounds the adapters of one step (the scheduler's).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import LoRAConfig
from kvserve.lora_request import LoRARequest
from kvserve.model.lora_adapter import read_lora_adapter
from kvserve.sampling_params import InvalidParameter
from kvserve.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class ServedAdapter:
    """An installed adapter: the request that named it first, and its content digest."""

    request: LoRARequest
    digest: str


class LoRAAdapters:
    def __init__(self, config: LoRAConfig, runner: ModelRunner) -> None:
        self.config = config
        self._runner = runner
        self._served: dict[int, ServedAdapter] = {}

    def resolve(self, lora_request: LoRARequest | None) -> ServedAdapter | None:
        """The adapter a request runs with, read and installed the first time its id comes; None for the base
        model. ``InvalidParameter`` where LoRA is off or the id names another adapter, ``LoRAAdapterError``
        (naming the adapter and the field) where its files are not one kvserve serves."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise InvalidParameter("lora_request", f"lora_request must be a LoRARequest, got "
                                                   f"{type(lora_request).__name__}")
        if not self.config.enable_lora:
            raise InvalidParameter("lora_request", f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is "
                                                   "off: start the engine with enable_lora=True (--enable-lora)")
        served = self._served.get(lora_request.lora_int_id)
        if served is None:
            adapter = read_lora_adapter(lora_request.lora_path, lora_request.lora_name, self.config.max_lora_rank)
            self._runner.add_lora(lora_request.lora_int_id, adapter)
            served = self._served[lora_request.lora_int_id] = ServedAdapter(lora_request, adapter.digest)
        elif served.request.lora_path != lora_request.lora_path:
            raise InvalidParameter("lora_request", f"lora_int_id {lora_request.lora_int_id} is adapter "
                                                   f"{served.request.lora_name!r} at {served.request.lora_path}, not "
                                                   f"{lora_request.lora_path}: one id names one adapter")
        return served

    @property
    def served(self) -> list[LoRARequest]:
        """The adapters installed, in the order they came."""
        return [served.request for served in self._served.values()]
