"""Sleep mode (vLLM's ``LLM(enable_sleep_mode=True)``, ``sleep(level)``, ``wake_up(tags)``): what an engine lets go
of while asleep, and the error a request sent meanwhile gets. No torch: the server maps ``EngineAsleep`` to its 503.

    level 1: the KV cache (its blocks, the prefix cache, the paged tensors' memory); the weights stay
    level 2: the weights too, read again from the checkpoint at wake-up

``wake_up`` brings back what its tags name (``WAKE_TAGS``; all where none is named), as vLLM's: the weights first,
then the KV cache, so that a caller can update weights between the two. The KV tiers (host and disk) are kept.
"""

from __future__ import annotations

from typing import Iterable

from kvserve.sampling_params import InvalidParameter

WEIGHTS, KV_CACHE = "weights", "kv_cache"
WAKE_TAGS = (WEIGHTS, KV_CACHE)
SLEEP_LEVELS = {1: frozenset({KV_CACHE}), 2: frozenset({KV_CACHE, WEIGHTS})}


class EngineAsleep(RuntimeError):
    """A request sent to an engine in sleep mode (a server's 503)."""

    def __init__(self, asleep: Iterable[str]) -> None:
        super().__init__(f"the engine is in sleep mode (its {' and '.join(sorted(asleep))} released): wake it up "
                         "first (LLM.wake_up(), or POST /wake_up)")


def released_by(level: object) -> frozenset[str]:
    """What sleep ``level`` releases; ``InvalidParameter`` naming ``level`` for any but 1 and 2."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise InvalidParameter("level", f"level must be 1 (the KV cache) or 2 (the KV cache and the weights), got "
                                        f"{level!r}")
    return SLEEP_LEVELS[level]  # type: ignore[index]


def woken_by(tags: Iterable[str] | None) -> frozenset[str]:
    """What ``wake_up(tags)`` brings back: every part where ``tags`` is None; ``InvalidParameter`` naming ``tags``
    for one that is not in ``WAKE_TAGS``."""
    if tags is None:
        return frozenset(WAKE_TAGS)
    if isinstance(tags, str):
        raise InvalidParameter("tags", f"tags is a list of {', '.join(WAKE_TAGS)}, got the string {tags!r}")
    unknown = [tag for tag in tags if tag not in WAKE_TAGS]
    if unknown:
        raise InvalidParameter("tags", f"unknown wake-up tags {unknown}: the tags are {', '.join(WAKE_TAGS)}")
    return frozenset(tags)
