"""The environment variables a server reads, and vLLM's, which a deployment moved from vLLM may still set.

The API keys (any one of them is accepted, as vLLM's ``--api-key K1 K2`` does) come from ``--api-key``, else
``$KVSERVE_API_KEY`` (keys a line each), else vLLM's ``$VLLM_API_KEY``, so that such a deployment does not start
open. ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (1 or true) turns on what ``--allow-runtime-lora-updating`` does, and
``$VLLM_SERVER_DEV_MODE`` vLLM's development endpoints (``dev_endpoints``), ``$VLLM_TORCH_PROFILER_DIR`` its
profiling endpoints (``profile_endpoints``); every other ``VLLM_*`` variable is read by nothing here, and a server
says so as it starts, with what to use instead where kvserve has it. Standard library only: the router reads it too.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

logger = logging.getLogger(__name__)

# the keys where no --api-key is given, a line each (no header holds a line break): out of `ps`, and inherited by
# local replicas
API_KEY_ENV = "KVSERVE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
VLLM_SERVER_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# the offline LLM reads it too, as ``engine/profiler.TRACE_DIR_ENV`` (this module is the router's too: no engine import)
VLLM_TORCH_PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"
# vLLM's variables with a kvserve counterpart -> that counterpart
VLLM_COUNTERPARTS = {
    "VLLM_CPU_KVCACHE_SPACE": "--kv-cache-memory GiB",
    "VLLM_LOGGING_LEVEL": "--log-level",
    "VLLM_ATTENTION_BACKEND": "--attention-backend (or $KVSERVE_ATTENTION_BACKEND)",
    "VLLM_CPU_OMP_THREADS_BIND": "taskset or numactl around kvserve",
}


def api_keys(flag: Sequence[str] | None) -> tuple[str, ...]:
    """The API keys a request may bring, any one: ``--api-key``'s, else ``$KVSERVE_API_KEY``'s lines (set empty:
    none), else ``$VLLM_API_KEY``; () requires none."""
    if flag is not None:
        return tuple(flag)
    if API_KEY_ENV in os.environ:  # split at line feeds alone: a key may hold any other character
        return tuple(key for key in os.environ[API_KEY_ENV].split("\n") if key)
    vllms = os.environ.get(VLLM_API_KEY_ENV)
    return (vllms,) if vllms else ()


def check_api_keys(keys: Sequence[str]) -> None:
    """ValueError naming a key no client could send: an empty one, or one holding a line break; TypeError for
    one string given as the keys (each of its characters would be a key)."""
    if isinstance(keys, str):
        raise TypeError("the API keys are a sequence of strings, got one string")
    for key in keys:
        if not key.strip() or "\n" in key or "\r" in key:  # "Bearer " reaches us stripped, if at all
            raise ValueError(f"--api-key must not be empty or hold a line break, got {key!r}: no client could send it")


def api_keys_variable(keys: Sequence[str]) -> dict[str, str]:
    """The environment that hands ``keys`` to a replica: ``$KVSERVE_API_KEY`` (none where no key is required)."""
    return {API_KEY_ENV: "\n".join(keys)} if keys else {}


def allows_runtime_lora_updating(flag: bool) -> bool:
    """Whether a server loads and unloads LoRA adapters at runtime: ``--allow-runtime-lora-updating``, else vLLM's
    ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` read as vLLM reads it (1 or true, in any case)."""
    return flag or _is_set(VLLM_RUNTIME_LORA_ENV)


def server_dev_mode() -> bool:
    """Whether a server serves vLLM's development endpoints (POST /reset_prefix_cache, ...): vLLM's
    ``$VLLM_SERVER_DEV_MODE``, read as vLLM reads it (1 or true, in any case)."""
    return _is_set(VLLM_SERVER_DEV_MODE_ENV)


def torch_profiler_dir() -> str | None:
    """Where a server's profiling endpoints (POST /start_profile, /stop_profile) write their traces: vLLM's
    ``$VLLM_TORCH_PROFILER_DIR``; None (the endpoints off) where unset or empty."""
    return os.environ.get(VLLM_TORCH_PROFILER_DIR_ENV) or None


def _is_set(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true")


def warn_of_vllm_environment() -> None:
    """A warning for each ``VLLM_*`` variable set that kvserve does not read, naming its counterpart."""
    read = (VLLM_API_KEY_ENV, VLLM_RUNTIME_LORA_ENV, VLLM_SERVER_DEV_MODE_ENV, VLLM_TORCH_PROFILER_DIR_ENV)
    for name in sorted(n for n in os.environ if n.startswith("VLLM_") and n not in read):
        counterpart = VLLM_COUNTERPARTS.get(name)
        instead = f"; use {counterpart}" if counterpart else ""
        logger.warning("$%s is vLLM's and kvserve does not read it%s", name, instead)
