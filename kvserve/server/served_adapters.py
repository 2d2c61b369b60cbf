"""``ServedAdapters``: the LoRA adapters a server serves by name (a request's ``model`` names one): those of
``--lora-modules`` from the start, and, with ``--allow-runtime-lora-updating`` (or vLLM's
``$VLLM_ALLOW_RUNTIME_LORA_UPDATING``), those loaded and unloaded through POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, as vLLM's server serves them.

A load reads and checks the adapter on a thread of its own (a bad one is a 400 naming what is wrong, the engine
untouched), installs it between two steps, and serves its name from then on. An unload stops serving the name at once
(a request naming it then is a 404); the requests already running or waiting with it finish with it, as vLLM's do,
and its weights leave the model after the last of them (``engine/lora_adapters.py``). Each adapter gets an id of its
own, never reused, so a request that named an adapter just unloaded is refused rather than run with another.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import TYPE_CHECKING

from kvserve.lora_request import LoRARequest
from kvserve.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.server.model_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


class ServedAdapters:
    """The adapters served, by name; loads and unloads one at a time (``load``, ``unload``)."""

    def __init__(self, start_up: tuple[LoRARequest, ...], model_names: tuple[str, ...]) -> None:
        self._by_name = {adapter.lora_name: adapter for adapter in start_up}
        self._model_names = model_names
        self._last_id = max((adapter.lora_int_id for adapter in start_up), default=0)
        self._updating = asyncio.Lock()  # a name checked free stays free while its adapter is read and installed

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter ``name`` (a request's ``model``) selects; None for a served model's name, or none."""
        return self._by_name.get(name) if name else None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    async def load(self, engine: AsyncEngine, body: LoadLoRAAdapterRequest) -> str:
        """Read, check and install the adapter of ``body``, then serve its name; 400 for a name served already
        or an adapter kvserve cannot serve (naming what is wrong)."""
        from kvserve.model.lora_adapter import read_lora_adapter

        async with self._updating:
            if body.lora_name in self._by_name or body.lora_name in self._model_names:
                what = "LoRA adapter" if body.lora_name in self._by_name else "model"
                raise APIError(HTTPStatus.BAD_REQUEST, f"the {what} {body.lora_name!r} has already been loaded: "
                                                       "unload it first, or give the adapter another name",
                               param="lora_name")
            self._last_id += 1
            request = LoRARequest(body.lora_name, self._last_id, body.lora_path)
            max_rank = engine.engine.config.lora.max_lora_rank
            try:
                adapter = await asyncio.to_thread(read_lora_adapter, body.lora_path, body.lora_name, max_rank)
                await engine.call(lambda e: e.lora_adapters.add(request, adapter))
            except ValueError as error:  # LoRAAdapterError, or LoRA off
                raise bad_request(error, param="lora_path") from error
            self._by_name[body.lora_name] = request
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, engine: AsyncEngine, body: UnloadLoRAAdapterRequest) -> str:
        """Stop serving the adapter of ``body``'s name; 404 for a name not served."""
        async with self._updating:
            request = self._by_name.pop(body.lora_name, None)
            if request is None:
                raise APIError(HTTPStatus.NOT_FOUND, f"the LoRA adapter {body.lora_name!r} cannot be found; this "
                                                     f"server serves {', '.join(self._by_name) or 'none'}",
                               param="lora_name")
            num_requests = await engine.call(lambda e: e.remove_lora(request.lora_int_id))
        finishing = f" ({num_requests} requests still running or waiting with it finish with it)" \
            if num_requests else ""
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully.{finishing}"
