"""The environment variables a server reads, and vLLM's, which a deployment moved from vLLM may still set.

The API key comes from ``--api-key``, else ``$KVSERVE_API_KEY``, else vLLM's ``$VLLM_API_KEY``, so that such a
deployment does not start open; every other ``VLLM_*`` variable is read by nothing here, and a server says so as
it starts, with what to use instead where kvserve has it. Standard library only: the router reads it too.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

API_KEY_ENV = "KVSERVE_API_KEY"  # the key where no --api-key is given: out of `ps`, and inherited by local replicas
VLLM_API_KEY_ENV = "VLLM_API_KEY"
# vLLM's variables with a kvserve counterpart -> that counterpart
VLLM_COUNTERPARTS = {
    "VLLM_CPU_KVCACHE_SPACE": "--kv-cache-memory GiB",
    "VLLM_LOGGING_LEVEL": "--log-level",
    "VLLM_ATTENTION_BACKEND": "--attention-backend (or $KVSERVE_ATTENTION_BACKEND)",
    "VLLM_CPU_OMP_THREADS_BIND": "taskset or numactl around kvserve",
}


def api_key(flag: str | None) -> str | None:
    """The API key to require: ``--api-key``, else ``$KVSERVE_API_KEY`` (set empty: none), else
    ``$VLLM_API_KEY``, else none."""
    if flag is not None:
        return flag
    if API_KEY_ENV in os.environ:
        return os.environ[API_KEY_ENV] or None
    return os.environ.get(VLLM_API_KEY_ENV) or None


def warn_of_vllm_environment() -> None:
    """A warning for each ``VLLM_*`` variable set that kvserve does not read, naming its counterpart."""
    for name in sorted(n for n in os.environ if n.startswith("VLLM_") and n != VLLM_API_KEY_ENV):
        counterpart = VLLM_COUNTERPARTS.get(name)
        instead = f"; use {counterpart}" if counterpart else ""
        logger.warning("$%s is vLLM's and kvserve does not read it%s", name, instead)
