"""KV tiers through the whole engine: with a device pool too small for the workload, the host and disk tiers
give the same tokens as a large pool (and transformers), a restarted or second engine on the same directory
reuses the blocks on disk, and bad files or a full disk never change an output. Gemma 3 runs in KV cache groups
(its sliding layers' blocks apart, ``kv/groups.py``), each group's blocks going through the tiers."""

from __future__ import annotations

import errno
import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.kv import disk_tier
from tests.conftest import assert_all_blocks_free, greedy_token_ids, hf_greedy

MAX_NEW = 6
SMALL_POOL = {"num_kv_blocks": 24, "max_num_seqs": 2, "block_size": 4}


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Three conversations of three turns, taking turns; each turn is the previous one plus new tokens. The
    three histories (8 to 12 blocks each) do not fit a pool of 24 blocks together: a conversation's next turn
    finds its history evicted, offloaded if tiers are on."""
    rng = random.Random(seed)
    histories = [[rng.randrange(3, vocab_size) for _ in range(32)] for _ in range(3)]
    prompts = []
    for _ in range(3):
        for history in histories:
            prompts.append(list(history))
            history += [rng.randrange(3, vocab_size) for _ in range(8)]
    return prompts


def _llm(path: Path, **options) -> LLM:
    return LLM(str(path), dtype="float32", **options)


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    # one request at a time, in order, as a user's turns arrive: each turn finds the previous in the tiers
    return [greedy_token_ids(llm, [prompt], MAX_NEW)[0][0] for prompt in prompts]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def family(request: pytest.FixtureRequest, tiny_checkpoints):
    path = tiny_checkpoints[request.param]
    prompts = _prompts(AutoModelForCausalLM.from_pretrained(path).config.vocab_size)
    expected = _run(_llm(path, num_kv_blocks=256, block_size=4), prompts)
    return path, prompts, expected


def test_a_small_pool_over_host_and_disk_tiers_matches_a_large_pool_and_transformers(family, tmp_path) -> None:
    path, prompts, expected = family
    llm = _llm(path, kv_offload_memory=0.01, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    assert _run(llm, prompts) == expected
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert expected == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    stats = llm.stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["kv_offload_host_hit_tokens"] > 0, stats
    # a hit of 4 tokens per block loaded; Gemma 3's KV cache groups load each group's blocks, group 0's count the tokens
    loaded_tokens, hit_tokens = stats["kv_offload_blocks_loaded"] * 4, stats["kv_offload_host_hit_tokens"]
    assert loaded_tokens == hit_tokens if stats["kv_cache_groups"] == 1 else loaded_tokens > hit_tokens
    assert_all_blocks_free(llm)


def test_without_tiers_the_small_pool_recomputes_what_it_evicted(family) -> None:
    path, prompts, expected = family
    llm = _llm(path, **SMALL_POOL)
    assert _run(llm, prompts) == expected
    recomputing_hits = llm.stats()["prefix_cache_hits"]
    assert "kv_offload_host_hit_tokens" not in llm.stats()
    tiered = _llm(path, kv_offload_memory=0.01, **SMALL_POOL)
    assert _run(tiered, prompts) == expected
    assert tiered.stats()["prefix_cache_hits"] > recomputing_hits


def test_a_restarted_engine_reuses_the_disk_tier(family, tmp_path) -> None:
    path, prompts, expected = family
    first = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    assert _run(first, prompts) == expected
    first.engine.flush_kv_offload()
    assert first.stats()["kv_offload_disk_hit_tokens"] == 0
    restarted = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    assert _run(restarted, prompts) == expected
    stats = restarted.stats()
    assert stats["kv_offload_disk_hit_tokens"] >= 32, stats  # the first turn's prompt, at least, came off disk
    assert stats["kv_offload_corrupt_blocks"] == 0
    assert_all_blocks_free(restarted)


def test_two_engines_share_one_directory(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints["llama"]
    prompts = _prompts(200, seed=1)
    a = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    b = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    expected = _run(a, prompts[:3])
    a.engine.flush_kv_offload()
    assert _run(b, prompts[:3]) == expected
    assert b.stats()["kv_offload_disk_hit_tokens"] >= 32


def test_blocks_on_disk_are_found_only_under_the_cache_salt_they_were_written_with(tiny_checkpoints,
                                                                                  tmp_path) -> None:
    """A salt's blocks chain from a root of its own (``block_keys.salted_root_key``): a second engine on the
    directory finds them under that salt only."""
    path = tiny_checkpoints["llama"]
    prompts = _prompts(200, seed=2)[:3]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)

    def run(llm: LLM, salt: str) -> list[list[int]]:
        outs = [llm.generate({"prompt_token_ids": p, "cache_salt": salt}, params, use_tqdm=False)[0] for p in prompts]
        return [out.outputs[0].token_ids for out in outs]

    writer = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    expected = run(writer, "tenant-1")
    writer.engine.flush_kv_offload()
    reader = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    assert run(reader, "tenant-2") == expected and reader.stats()["kv_offload_disk_hit_tokens"] == 0
    assert run(reader, "tenant-1") == expected and reader.stats()["kv_offload_disk_hit_tokens"] >= 32
    assert_all_blocks_free(reader)


def test_a_checkpoint_with_another_configuration_never_uses_the_blocks_on_disk(tiny_checkpoints, tmp_path) -> None:
    """The same weights under another rope theta make other KV: blocks written for the original configuration
    are not this model's (its identity covers the configuration), so nothing comes off disk and the output is
    the altered model's own."""
    path = tiny_checkpoints["llama"]
    altered = tmp_path / "altered"
    shutil.copytree(path, altered)
    config = json.loads((altered / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500.0
    (altered / "config.json").write_text(json.dumps(config))
    prompts = _prompts(200, seed=4)[:3]
    first = _llm(path, kv_offload_dir=str(tmp_path / "kv"), **SMALL_POOL)
    _run(first, prompts)
    first.engine.flush_kv_offload()
    expected = _run(_llm(altered, **SMALL_POOL), prompts)
    reused = _llm(altered, kv_offload_dir=str(tmp_path / "kv"), **SMALL_POOL)
    assert _run(reused, prompts) == expected
    assert reused.stats()["kv_offload_disk_hit_tokens"] == 0


def test_a_prefix_on_disk_longer_than_the_host_tier_loads_what_the_tier_can_stage(tiny_checkpoints, tmp_path) -> None:
    """40 blocks on disk, a host tier of 16 rows: the first 16 are read and loaded, the rest computed. Reading them
    all would have each read evict an earlier one before it loads, lookup after lookup (3,200 reads, nothing
    loaded)."""
    path = tiny_checkpoints["llama"]
    prompt = [random.Random(5).randrange(3, 200) for _ in range(161)]
    options = {"block_size": 4, "num_kv_blocks": 128, "kv_offload_dir": str(tmp_path)}
    writer = _llm(path, **options)
    expected = greedy_token_ids(writer, [prompt], MAX_NEW)[0][0]
    writer.engine.flush_kv_offload()
    bytes_per_block = writer.engine.core.kv_manager.store.format.bytes_per_block
    reader = _llm(path, kv_offload_memory=16 * bytes_per_block / 2**30, **options)
    assert greedy_token_ids(reader, [prompt], MAX_NEW)[0][0] == expected
    stats = reader.stats()
    assert stats["kv_offload_disk_reads"] == 16 and stats["kv_offload_disk_hit_tokens"] == 16 * 4, stats
    assert_all_blocks_free(reader)


def test_requests_waiting_on_disk_reads_together_use_every_block_they_read(tiny_checkpoints, tmp_path) -> None:
    """Six prefixes of 6 blocks on disk, a host tier of 12 rows, the six sent together: each waiting request
    read as much as the whole tier could stage, evicting the others' reads before they loaded (60 reads, 12
    blocks used). Rows staged for one waiting request are now kept from the others' reads."""
    path = tiny_checkpoints["llama"]
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 400) for _ in range(100)] for _ in range(6)]
    options = {"num_kv_blocks": 16, "kv_offload_dir": str(tmp_path)}
    writer = _llm(path, **options)
    expected = greedy_token_ids(writer, prompts, 4)
    writer.engine.flush_kv_offload()
    bytes_per_block = writer.engine.core.kv_manager.store.format.bytes_per_block
    reader = _llm(path, kv_offload_memory=12 * bytes_per_block / 2**30, **options)
    assert greedy_token_ids(reader, prompts, 4) == expected
    stats = reader.stats()
    assert stats["kv_offload_disk_hit_tokens"] == stats["kv_offload_disk_reads"] * 16 >= 2 * 96, stats
    assert_all_blocks_free(reader)


def test_corrupt_block_files_are_skipped_and_recomputed(tiny_checkpoints, tmp_path, caplog) -> None:
    path = tiny_checkpoints["llama"]
    prompts = _prompts(200, seed=2)
    first = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    expected = _run(first, prompts)
    first.engine.flush_kv_offload()
    files = sorted(tmp_path.rglob("*.kvb"))
    for index, file in enumerate(files):
        data = bytearray(file.read_bytes())
        if index % 2:
            data[-1] ^= 0x01  # a flipped bit
        else:
            del data[-10:]  # truncated
        file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        second = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
        assert _run(second, prompts) == expected
    stats = second.stats()
    assert stats["kv_offload_corrupt_blocks"] > 0 and stats["kv_offload_disk_hit_tokens"] == 0, stats
    assert "skipping block file" in caplog.text
    assert_all_blocks_free(second)


def test_a_full_disk_changes_no_output(tiny_checkpoints, tmp_path, monkeypatch, caplog) -> None:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "write_block_file", full)
    path = tiny_checkpoints["llama"]
    prompts = _prompts(200, seed=3)
    expected = _run(_llm(path, **SMALL_POOL), prompts)
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        llm = _llm(path, kv_offload_memory=0.01, kv_offload_dir=str(tmp_path), **SMALL_POOL)
        assert _run(llm, prompts) == expected
        llm.engine.flush_kv_offload()
    assert caplog.text.count("no more blocks are written there") == 1
    assert not llm.stats()["kv_offload_disk_writable"]
    assert llm.stats()["kv_offload_host_hit_tokens"] > 0


def test_a_steps_offloads_go_to_the_disk_writer_before_its_forward_pass(tiny_checkpoints, tmp_path) -> None:
    """Written while the step computes: queued only after it, their rows stayed pinned into the next plan, where a
    small host tier then had fewer rows to give (more offloads dropped, and counts that varied run to run)."""
    llm = _llm(tiny_checkpoints["llama"], kv_offload_memory=0.01, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    store, runner, events = llm.engine.core.kv_manager.store, llm.engine.core.runner, []
    assert runner.host_copies.after_offloads == store.publish_offloads  # as the engine wires them
    reserve, publish, forward = store.reserve_offload_rows, store.publish_offloads, runner.model.forward

    def reserving(blocks):
        rows = reserve(blocks)
        events.extend(["reserved"] * bool(rows))
        return rows

    store.reserve_offload_rows = reserving
    runner.host_copies.after_offloads = lambda: (events.append("writes queued"), publish())
    runner.model.forward = lambda *args, **kwargs: (events.append("forward"), forward(*args, **kwargs))[1]
    _run(llm, _prompts(200, seed=6))
    after_reserving = [events[i + 1] for i, event in enumerate(events[:-1]) if event == "reserved"]
    assert after_reserving and set(after_reserving) == {"writes queued"}


@pytest.mark.parametrize("disk", [False, True])
def test_a_request_forking_over_blocks_loaded_from_the_tiers_shares_them(tiny_checkpoints, tmp_path, disk) -> None:
    """n = 2 whose prompt but its last token comes back from the tiers forks as it is admitted, over blocks whose
    load is still to come: they are the samples' own, on the tree (a sample re-added one: a ValueError)."""
    path = tiny_checkpoints["llama"]
    prompts = _prompts(200, seed=7)
    forking = prompts[0] + [5]  # 8 whole blocks of 4 tokens, then its last token
    expected = greedy_token_ids(_llm(path, num_kv_blocks=256, block_size=4), [forking], MAX_NEW, n=2)
    options = {"kv_offload_dir": str(tmp_path)} if disk else {"kv_offload_memory": 0.01}
    llm = _llm(path, **options, **SMALL_POOL)
    _run(llm, prompts[:3])  # the first history goes to the tiers as the next two evict it
    assert greedy_token_ids(llm, [forking], MAX_NEW, n=2) == expected
    stats = llm.stats()
    assert stats["kv_offload_host_hit_tokens"] + stats["kv_offload_disk_hit_tokens"] > 0, stats  # loaded
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_quantized_kv_blocks_go_through_the_tiers_unchanged(tiny_checkpoints, tmp_path, kv_cache_dtype) -> None:
    path = tiny_checkpoints["llama"]
    prompts = _prompts(200, seed=4)
    expected = _run(_llm(path, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256, block_size=4), prompts)
    llm = _llm(path, kv_cache_dtype=kv_cache_dtype, kv_offload_memory=0.01, kv_offload_dir=str(tmp_path),
               **SMALL_POOL)
    assert _run(llm, prompts) == expected
    assert llm.stats()["kv_offload_host_hit_tokens"] > 0
    # int4's first layout (whole-row groups, keys as they are) filed its blocks as "int4": a server of today's
    # layout keys and files its own under another name, so it never reads one of those as its own
    layout = {"int8": "int8", "int4": "int4-g64-hadamard-keys"}[kv_cache_dtype]
    assert llm.engine.core.kv_manager.store.format.kv_dtype == layout


def test_n_samples_and_preemption_over_the_tiers(tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama"]
    prompts = _prompts(200, seed=5)
    options = {"num_kv_blocks": 20, "max_num_seqs": 4, "block_size": 4}
    expected = greedy_token_ids(_llm(path, num_kv_blocks=256, block_size=4), prompts, MAX_NEW, n=2)
    llm = _llm(path, kv_offload_memory=0.01, **options)
    assert greedy_token_ids(llm, prompts, MAX_NEW, n=2) == expected
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_the_model_identity_names_the_fused_ops(tiny_checkpoints) -> None:
    """The C fused ops' rounding is not their twin's (half the K/V floats of a block differ): an engine whose C
    kernels did not build must not read blocks written by one whose did."""
    from kvserve.model.layers.fused_ops import TorchFusedOps, UsesFusedOps

    runner = _llm(tiny_checkpoints["llama"], **SMALL_POOL).engine.core.runner
    with_kernels = runner.model_identity()
    assert any(type(m.ops) is not TorchFusedOps for m in runner.model.modules() if isinstance(m, UsesFusedOps))
    for module in runner.model.modules():
        if isinstance(module, UsesFusedOps):
            module.ops = TorchFusedOps()
    assert runner.model_identity() != with_kernels
