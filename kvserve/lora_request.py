"""``LoRARequest``: the LoRA adapter a request runs with, as vLLM's ``LLM.generate(..., lora_request=...)`` takes it.

Plain data (no torch): the engine reads the adapter's directory the first time its ``lora_int_id`` comes
(``engine/lora_adapters.py``) and keeps it loaded under that id until it is removed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.sampling_params import InvalidParameter


@dataclass(frozen=True)
class LoRARequest:
    """``LoRARequest(name, int_id, path)``: an adapter directory in PEFT's format (adapter_config.json and
    adapter_model.safetensors), named ``lora_name`` and identified by ``lora_int_id`` (> 0, as in vLLM: 0 is the
    base model). One id names one adapter for the engine's life: the same id with another path, or once the adapter was
    removed, is refused."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidParameter("lora_name", f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidParameter("lora_int_id", f"lora_int_id must be an integer >= 1 (0 is the base model), "
                                                  f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidParameter("lora_path", f"lora_path must name the adapter's directory, got "
                                                f"{self.lora_path!r}")


class RemovedLoRAAdapter(InvalidParameter):
    """A ``LoRARequest`` whose id names an adapter since removed (``LLMEngine.remove_lora``): a server answers it
    as a name it does not serve, since its client named the adapter before the unload reached the engine."""

    def __init__(self, lora_request: LoRARequest, removed_name: str) -> None:
        super().__init__("lora_request", f"lora_int_id {lora_request.lora_int_id} was adapter {removed_name!r}, "
                                         "since removed: an id names one adapter for the engine's life (give a new "
                                         "one)")
        self.lora_name = lora_request.lora_name
