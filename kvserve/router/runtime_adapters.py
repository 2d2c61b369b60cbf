"""The LoRA adapters loaded through the router at runtime, remembered so that a replica that comes (back) up knowing
only its ``--lora-modules`` is given them again (``Router.replay_adapters``) before it serves."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.router.prompts import request_payload


@dataclass(frozen=True)
class AdapterLoad:
    """A load every replica took: its body and the client's forwarded headers (its key), sent again as they came."""

    name: str
    body: bytes
    headers: list[tuple[bytes, bytes]]


class RuntimeAdapters:
    """Adapter name -> the load that every replica took, in load order (a replayed load may depend on none other,
    but replicas then hold them in the order the clients chose)."""

    def __init__(self) -> None:
        self._loads: dict[str, AdapterLoad] = {}

    def remember(self, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        name = _name(body)
        self._loads.pop(name, None)  # a name loaded again (after an unload elsewhere) goes last, as it was loaded
        self._loads[name] = AdapterLoad(name, body, list(headers))

    def forget(self, body: bytes) -> None:
        self._loads.pop(_name(body), None)

    def loads(self) -> list[AdapterLoad]:
        return list(self._loads.values())


def _name(body: bytes) -> str:
    return str(request_payload(body).get("lora_name"))
