"""EngineCore's sizing of the KV pool: options that change nothing where they run are warned of."""

from __future__ import annotations

from kvserve import LLM


def test_gpu_memory_utilization_off_cuda_is_warned_of(tiny_checkpoints, caplog) -> None:
    """Like --cpu-offload-gb: asked for where it changes nothing, it is heard at the default log level."""
    with caplog.at_level("WARNING"):
        LLM(str(tiny_checkpoints["llama"]), gpu_memory_utilization=0.5)
    assert "--gpu-memory-utilization is not used" in caplog.text
