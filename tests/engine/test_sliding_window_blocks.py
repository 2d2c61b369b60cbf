"""Sliding-window layers free the KV blocks their window has passed (``kv/groups.py``), through the whole engine:
greedy output far past the window equals transformers' (fp32) for Gemma 3 (sliding and full layers), Mistral
(every layer windowed) and Qwen2 with ``layer_types``, alone, batched, in small chunks, with n = 2, under
preemption (by recompute, and by swap through the host tier), over the host and disk KV tiers (a prefix evicted,
offloaded and restored, and found on disk by a restarted engine) and through CPU step graphs, while the window
groups hold a bounded number of blocks and the full group grows with the context; int8 KV gives the one-table
layout's tokens; features that keep one table per request fall back to it, saying why."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
from pathlib import Path
from typing import Iterator
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine_args import EngineArgs
from kvserve.kv.groups import KVCacheGroups
from tests.conftest import assert_all_blocks_free, greedy_token_ids, hf_greedy

WINDOW = 12  # the tiny checkpoints'
BLOCK_SIZE = 4
MAX_NEW = 40
LENGTHS = [40, 5, 70, 17]
FAMILIES = {"gemma3": 2, "mistral": 1, "qwen2-layer-types": 2}  # family -> KV cache groups
HYBRID = sorted(f for f, num_groups in FAMILIES.items() if num_groups > 1)
OPTIONS = {"dtype": "float32", "enable_prefix_caching": False, "block_size": BLOCK_SIZE, "num_kv_blocks": 96}


def qwen2_with_layer_types(tiny_qwen2: Path, out_dir: Path) -> Path:
    """The tiny Qwen2 with its first layer sliding (window 12) and its second full, as HF's ``layer_types``."""
    path = out_dir / "qwen2-layer-types"
    shutil.copytree(tiny_qwen2, path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                  layer_types=["sliding_attention", "full_attention"])
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tiny_checkpoints, tmp_path_factory):
    return _family(request.param, tiny_checkpoints, tmp_path_factory)


@pytest.fixture(scope="module", params=HYBRID)
def hybrid_family(request: pytest.FixtureRequest, tiny_checkpoints, tmp_path_factory):
    """A family with full and sliding layers: the prefix cache keeps its groups (an all-window model keeps one
    table with the prefix cache, tested in the fallbacks)."""
    return _family(request.param, tiny_checkpoints, tmp_path_factory)


def _family(name: str, tiny_checkpoints, tmp_path_factory):
    if name == "qwen2-layer-types":
        path = qwen2_with_layer_types(tiny_checkpoints["qwen2"], tmp_path_factory.mktemp("qwen2"))
    else:
        path = tiny_checkpoints[name]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in LENGTHS]
    return name, path, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def window_bound(llm: LLM, max_chunk: int) -> int:
    """The most blocks one request's window groups may hold: each its window plus a chunk, over block edges."""
    groups = llm.engine.core.kv_manager.groups
    num_window_groups = sum(w is not None for w in groups.windows)
    return num_window_groups * ((WINDOW - 1 + max_chunk) // BLOCK_SIZE + 2)


@contextlib.contextmanager
def tracking_blocks(llm: LLM) -> Iterator[list[tuple[int, int]]]:
    """A list that gets, after every engine step run inside the block, the blocks held in window groups and in
    full groups."""
    core, held = llm.engine.core, []
    step = core.step

    def tracked():
        outputs = step()
        stats = llm.stats()
        held.append((stats["kv_blocks_windowed"], stats["kv_blocks_full"]))
        return outputs

    core.step = tracked
    try:
        yield held
    finally:
        core.step = step


def one_table_llm(path: str, **options) -> LLM:
    """The model in the plain layout, one block table for every layer (as a feature that keeps one gets it): the
    reference the grouped layout's tokens are held to where transformers' are not the measure."""
    with mock.patch.object(LLMEngine, "_why_one_block_table", lambda engine, groups: "the test's reference"):
        return LLM(path, **options)


def generate_tracking_blocks(llm: LLM, prompts: list[list[int]], n: int = 1) -> tuple[list, list[tuple[int, int]]]:
    """Greedy samples, and after every engine step the blocks held in window groups and in full groups."""
    with tracking_blocks(llm) as held:
        return greedy_token_ids(llm, prompts, MAX_NEW, n), held


def test_alone_far_past_the_window_with_bounded_window_blocks(family) -> None:
    name, path, prompts, expected = family
    llm = LLM(str(path), **OPTIONS)
    assert llm.stats()["kv_cache_groups"] == FAMILIES[name]
    for prompt, want in zip(prompts, expected):
        samples, held = generate_tracking_blocks(llm, [prompt])
        assert samples[0][0] == want
        assert max(w for w, _ in held) <= window_bound(llm, len(prompt))
        if FAMILIES[name] > 1:  # the full group holds every block of the context (seen after the step before
            # the last, whose KV ends 2 tokens short of prompt + outputs; the last step frees them all)
            assert max(f for _, f in held) == -(-(len(prompt) + MAX_NEW - 2) // BLOCK_SIZE)
    assert_all_blocks_free(llm)
    assert llm.stats()["kv_blocks_windowed"] == 0


def test_batched_in_chunks_of_8(family) -> None:
    _, path, prompts, expected = family
    llm = LLM(str(path), **OPTIONS, max_num_batched_tokens=8)
    samples, held = generate_tracking_blocks(llm, prompts)
    assert [s[0] for s in samples] == expected
    assert max(w for w, _ in held) <= len(prompts) * window_bound(llm, 8)
    assert_all_blocks_free(llm)


def test_n_samples_fork_every_group(family) -> None:
    _, path, prompts, expected = family
    llm = LLM(str(path), **OPTIONS)
    for samples, want in zip(greedy_token_ids(llm, prompts, MAX_NEW, n=2), expected):
        assert samples == [want] * 2
    assert_all_blocks_free(llm)


def test_preemption_under_a_small_pool(family) -> None:
    name, path, prompts, expected = family
    # Mistral's requests hold at most (12 - 1 + 16) // 4 + 2 = 8 blocks each: 20 would run all four at once
    llm = LLM(str(path), **{**OPTIONS, "num_kv_blocks": 10 if name == "mistral" else 20}, max_num_batched_tokens=16)
    assert [s[0] for s in greedy_token_ids(llm, prompts, MAX_NEW)] == expected
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_swap_preemption_under_a_small_pool(family) -> None:
    name, path, prompts, expected = family
    assert_swaps_every_group(path, prompts, expected, 10 if name == "mistral" else 20, prefix_caching=False)


def test_swap_preemption_with_the_prefix_cache(hybrid_family) -> None:
    _, path, prompts, expected = hybrid_family
    assert_swaps_every_group(path, prompts, expected, 20, prefix_caching=True)


def assert_swaps_every_group(path: Path, prompts: list[list[int]], expected: list[list[int]], num_kv_blocks: int,
                             prefix_caching: bool) -> None:
    """Preempted requests' KV of every group goes to host rows (of a window group, only the blocks its next query
    sees) and comes back into fresh blocks or, with the prefix cache, the blocks the tree still holds: tokens are
    transformers', the window groups stay bounded, and every block and host row is given back."""
    llm = LLM(str(path), **{**OPTIONS, "num_kv_blocks": num_kv_blocks, "enable_prefix_caching": prefix_caching},
              max_num_batched_tokens=16, preemption_mode="swap", kv_offload_memory=0.01)
    assert llm.stats()["kv_cache_groups"] > 1 or llm.engine.core.kv_manager.groups.windows == (WINDOW,)
    samples, held = generate_tracking_blocks(llm, prompts)
    assert [s[0] for s in samples] == expected
    stats = llm.stats()
    assert stats["num_swapped_out"] == stats["num_swapped_in"] >= stats["num_preemptions"] > 0, stats
    assert stats["num_blocks_swapped_in"] + stats["num_blocks_swap_in_found_on_device"] == \
        stats["num_blocks_swapped_out"] > 0 and stats["num_swap_fallbacks"] == 0, stats
    assert max(w for w, _ in held) <= len(prompts) * window_bound(llm, 16)
    assert_all_blocks_free(llm)
    host = llm.engine.core.kv_manager.store.host
    assert len(host._free) + host.num_blocks == host.num_rows, "swapped-out rows outlived their requests"


def test_host_and_disk_tiers_restore_an_evicted_prefix(hybrid_family, tmp_path) -> None:
    """A pool too small for the prompts' prefixes together: every group's blocks evicted go to the host tier and
    come back on the next pass; a restarted engine finds them on the disk; tokens are transformers' and the window
    groups stay bounded."""
    _, path, prompts, expected = hybrid_family
    options = {**OPTIONS, "enable_prefix_caching": True, "num_kv_blocks": 20, "max_num_batched_tokens": 16,
               "kv_offload_dir": str(tmp_path)}
    llm = LLM(str(path), **options, kv_offload_memory=0.01)
    assert llm.stats()["kv_cache_groups"] == 2
    held = []
    for _ in range(2):  # one prompt at a time: each finds what the others evicted in the host tier
        for prompt, want in zip(prompts, expected):
            samples, held_now = generate_tracking_blocks(llm, [prompt])
            assert samples[0][0] == want
            held += held_now
    stats = llm.stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["kv_offload_host_hit_tokens"] > 0, stats
    assert max(w for w, _ in held) <= window_bound(llm, 16)
    assert_all_blocks_free(llm)
    llm.engine.flush_kv_offload()
    restarted = LLM(str(path), **options)
    samples, held = generate_tracking_blocks(restarted, prompts)
    assert [s[0] for s in samples] == expected
    stats = restarted.stats()
    assert stats["kv_offload_disk_hit_tokens"] >= sum(len(p) - BLOCK_SIZE for p in prompts if len(p) > WINDOW), stats
    assert stats["kv_offload_corrupt_blocks"] == 0
    assert max(w for w, _ in held) <= len(prompts) * window_bound(restarted, 16)
    assert_all_blocks_free(restarted)


def test_int8_kv_gives_the_one_table_layouts_tokens(family) -> None:
    _, path, prompts, _ = family
    one_table = one_table_llm(str(path), **OPTIONS, kv_cache_dtype="int8")
    assert one_table.stats()["kv_cache_groups"] == 1
    grouped = LLM(str(path), **OPTIONS, kv_cache_dtype="int8", max_num_batched_tokens=16)
    assert greedy_token_ids(grouped, prompts, MAX_NEW) == greedy_token_ids(one_table, prompts, MAX_NEW)
    assert_all_blocks_free(grouped)


def test_a_step_graph_replay_equals_the_eager_forward_with_groups(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["gemma3"]), **OPTIONS, max_num_seqs=3)
    runner = llm.engine.core.runner
    forward, hidden = runner._forward, []

    def both(batch):
        replayed = forward(batch).clone()
        eager = runner.model(batch.input_ids, batch.positions, runner.step_metadata(batch.attn), runner.kv)
        hidden.append((replayed, eager))
        return replayed

    runner._forward = both
    rng = random.Random(1)
    greedy_token_ids(llm, [[rng.randrange(3, 500) for _ in range(n)] for n in (30, 7, 50)], MAX_NEW)
    assert runner.graphs.num_replays > 0
    assert all(torch.equal(replayed, eager) for replayed, eager in hidden)


def test_the_prefix_cache_without_a_full_layer_keeps_one_table_and_says_so(tiny_checkpoints, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.engine.llm_engine"):
        llm = LLM(str(tiny_checkpoints["mistral"]), dtype="float32", num_kv_blocks=64)
    assert llm.stats()["kv_cache_groups"] == 1 and llm.engine.core.kv_manager.groups.windows == (None,)
    assert "sliding-window layers keep all their KV blocks" in caplog.text and "prefix cache" in caplog.text


@pytest.mark.parametrize(("options", "windows", "reason"), [
    ({}, [12, None], None),
    ({"enable_prefix_caching": True}, [12, None], None),
    ({"enable_prefix_caching": True}, [12, 12], "prefix cache"),
    ({"enable_prefix_caching": True}, [12, None, None], "prefix cache"),  # two full groups of one layer
    ({"preemption_mode": "swap", "kv_offload_memory": 0.01}, [12, None], None),
    ({"enable_prefix_caching": True, "kv_offload_memory": 0.01, "kv_offload_dir": "kv"}, [12, None], None),
    ({"tensor_parallel_size": 2}, [12, None], None),
    ({"speculative_method": "draft", "draft_model": "any"}, [12, None], "draft model"),
])
def test_features_that_keep_one_table_are_named(options: dict, windows: list, reason: str | None) -> None:
    args = EngineArgs(model="any", **{"enable_prefix_caching": False, **options})
    engine = LLMEngine.__new__(LLMEngine)  # the reason reads the configuration only
    engine.config = args.create_engine_config()
    found = engine._why_one_block_table(KVCacheGroups.of_layers(windows))
    assert found is None if reason is None else reason in found


def test_a_model_without_windows_keeps_the_plain_layout(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), **OPTIONS)
    stats = llm.stats()
    assert stats["kv_cache_groups"] == 1 and stats["num_blocks_total"] == OPTIONS["num_kv_blocks"]
    assert llm.engine.core.runner.kv_cache_spec().layer_tensors == ()



@pytest.mark.parametrize("max_num_batched_tokens", [8, 256])
def test_prefix_hits_take_every_groups_blocks_and_keep_the_tokens(hybrid_family, max_num_batched_tokens: int) -> None:
    """Hybrid families with the prefix cache: a second pass over the prompts, and prompts extending the first
    ones' outputs (a conversation's next turn), hit the cache and give transformers' tokens; the window groups
    stay bounded."""
    _, path, prompts, expected = hybrid_family
    llm = LLM(str(path), **{**OPTIONS, "enable_prefix_caching": True}, max_num_batched_tokens=max_num_batched_tokens)
    assert llm.stats()["kv_cache_groups"] == 2
    assert [s[0] for s in greedy_token_ids(llm, prompts, MAX_NEW)] == expected
    hits = llm.stats()["prefix_cache_hits"]
    samples, held = generate_tracking_blocks(llm, prompts)
    assert [s[0] for s in samples] == expected
    assert llm.stats()["prefix_cache_hits"] - hits >= sum(len(p) - WINDOW for p in prompts if len(p) > 2 * WINDOW)
    assert max(w for w, _ in held) <= len(prompts) * window_bound(llm, max_num_batched_tokens)
    assert_all_blocks_free(llm)


def test_a_conversations_next_turn_hits_past_the_window(hybrid_family) -> None:
    _, path, prompts, expected = hybrid_family
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), **{**OPTIONS, "enable_prefix_caching": True})
    turn = prompts[2]
    for _ in range(3):
        out = greedy_token_ids(llm, [turn], MAX_NEW)[0][0]
        assert out == hf_greedy(hf, turn, MAX_NEW)
        turn = turn + out + [7, 8, 9]
    assert llm.stats()["prefix_cache_hits"] >= 2 * len(prompts[2])
    assert_all_blocks_free(llm)


def test_a_window_as_long_as_the_context_keeps_the_plain_layout(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["gemma3"]), **OPTIONS, max_model_len=WINDOW)
    assert llm.stats()["kv_cache_groups"] == 1
    rng = random.Random(2)
    assert len(greedy_token_ids(llm, [[rng.randrange(3, 500) for _ in range(8)]], 4)[0][0]) == 4


def test_logprobs_and_prompt_logprobs_equal_the_one_table_layouts(tiny_checkpoints) -> None:
    """Sampled logprobs, the second time from prefix hits, and prompt logprobs (which take no hit on a prompt
    whose logprobs were never returned) equal those of the plain layout."""
    from kvserve import SamplingParams

    path = str(tiny_checkpoints["gemma3"])
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(n)]} for n in (45, 30)]
    sampled = SamplingParams(temperature=0, max_tokens=20, logprobs=2)
    prompt = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)

    def scored(llm: LLM) -> list:
        outs = [o for params in (sampled, sampled, prompt) for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(o.outputs[0].token_ids, [sorted(p.items()) for p in o.outputs[0].logprobs or []],
                 [sorted(p.items()) for p in o.prompt_logprobs or [] if p]) for o in outs]

    grouped = LLM(path, **{**OPTIONS, "enable_prefix_caching": True}, max_num_batched_tokens=16)
    one_table = one_table_llm(path, **OPTIONS)
    assert grouped.stats()["kv_cache_groups"] == 2 and one_table.stats()["kv_cache_groups"] == 1
    got, want = scored(grouped), scored(one_table)
    assert grouped.stats()["prefix_cache_hits"] > 0
    for (tokens, logprobs, prompt_logprobs), (w_tokens, w_logprobs, w_prompt_logprobs) in zip(got, want):
        assert tokens == w_tokens and len(logprobs + prompt_logprobs) == len(w_logprobs + w_prompt_logprobs)
        for mine, theirs in zip(logprobs + prompt_logprobs, w_logprobs + w_prompt_logprobs):
            assert [t for t, _ in mine] == [t for t, _ in theirs]
            assert [lp.logprob for _, lp in mine] == pytest.approx([lp.logprob for _, lp in theirs], abs=1e-5)
    assert_all_blocks_free(grouped)


def test_the_reference_backend_with_groups_and_prefix_hits_gives_the_one_table_layouts_tokens(tiny_checkpoints) -> None:
    """bf16 runs the plain-PyTorch backend (``TorchRefBackend``) on CPU: per-group metadata, a second pass from
    prefix hits, the same tokens as the plain layout."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 70, 17)]
    options = {**OPTIONS, "dtype": "bfloat16", "max_num_batched_tokens": 16}
    grouped = LLM(str(tiny_checkpoints["gemma3"]), **{**options, "enable_prefix_caching": True})
    one_table = one_table_llm(str(tiny_checkpoints["gemma3"]), **options)
    assert type(grouped.engine.core.runner.backend).__name__ == "TorchRefBackend"
    want = greedy_token_ids(one_table, prompts, MAX_NEW)
    assert greedy_token_ids(grouped, prompts, MAX_NEW) == want == greedy_token_ids(grouped, prompts, MAX_NEW)
    assert grouped.stats()["prefix_cache_hits"] > 0 and grouped.stats()["kv_cache_groups"] == 2
    assert_all_blocks_free(grouped)
