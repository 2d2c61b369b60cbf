"""A server with a KV disk tier, stopped with SIGTERM and started again on the same directory: the second
server answers a long prompt from the blocks the first wrote, with the same text, and says so in /metrics."""

from __future__ import annotations

from pathlib import Path

from tests.server.conftest import MODEL_NAME

PROMPT = "The history of a conversation that a user comes back to after the server restarted. " * 5


def _ask(server) -> tuple[str, int]:
    answer = server.openai().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    return answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens


def test_a_restarted_server_serves_the_prefix_from_disk(start_server, tmp_path: Path) -> None:
    flags = ("--kv-offload-dir", str(tmp_path), "--block-size", "4")
    first = start_server(*flags)
    text, cached = _ask(first)
    assert cached == 0
    assert first.metric("kvserve:kv_offload_disk_hit_tokens_total") == 0
    first.terminate()
    assert first.process.wait(30) == 0
    assert any(tmp_path.rglob("*.kvb"))

    second = start_server(*flags)
    assert second.metric("kvserve:kv_offload_disk_blocks") > 0
    again, cached = _ask(second)
    assert again == text and cached >= 64
    assert second.metric("kvserve:kv_offload_disk_hit_tokens_total") == cached
    assert second.metric("kvserve:kv_offload_corrupt_blocks_total") == 0
    assert second.metric("kvserve:kv_offload_disk_reads_skipped_total") == 0  # no prefill measured yet: read
    assert second.metric("kvserve:cache_config_info", cache_dtype="float32") == 1
