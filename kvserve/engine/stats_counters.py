"""Which keys of ``LLMEngine.stats()`` count since the engine started; the others are states, settings, peaks
and rates. A run's own figure of a counter is after minus before (``kvserve bench throughput`` leaves its
warm-up out so), and the server mirrors the ones it exports as Prometheus counters. Plain data: its readers
import no torch."""

from __future__ import annotations

COUNTER_STATS = frozenset({
    # the scheduler and the runner
    "num_preemptions", "num_steps_scheduled_ahead", "num_tokens_computed", "num_graph_replays",
    # preemption by swap
    "num_swapped_out", "num_swapped_in", "num_blocks_swapped_out", "num_blocks_swapped_in",
    "num_blocks_swap_in_found_on_device", "num_swap_fallbacks",
    # the prefix cache
    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions",
    # speculative decoding
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_emitted_tokens",
    # the KV tiers (kv/tiers.py) and the runner's copies to and from them (worker/kv_transfers.py)
    "kv_offload_host_hit_tokens", "kv_offload_disk_hit_tokens", "kv_offload_blocks_offloaded",
    "kv_offload_offloaded_bytes", "kv_offload_blocks_loaded", "kv_offload_loaded_bytes", "kv_offload_blocks_dropped",
    "kv_offload_disk_writes", "kv_offload_disk_write_errors", "kv_offload_disk_reads", "kv_offload_disk_reads_skipped",
    "kv_offload_corrupt_blocks", "kv_offload_seconds", "kv_reload_seconds", "kv_swap_seconds",
    # structured output's token masks
    "grammar_mask_steps", "grammar_mask_rows", "grammar_mask_fill_seconds", "grammar_mask_wait_seconds",
})
