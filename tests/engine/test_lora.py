"""LoRA adapters through the whole engine: a request with an adapter gives transformers' greedy tokens of the base
checkpoint with the adapter merged into its weights (W + scale * B @ A, computed here: peft is not installed), for
Llama, Qwen2 and Gemma 3; a batch mixing adapters and the base model gives each row's tokens alone; an adapter of
zeros gives the base model's; cached KV is never shared across adapters, in the prefix cache nor on disk."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.model.lora_checkpoint import make_lora_adapter
from kvserve.sampling_params import InvalidParameter
from tests.conftest import assert_all_blocks_free, hf_greedy

MAX_NEW = 8


def merged_transformers(base: Path, adapter: Path) -> torch.nn.Module:
    """transformers' fp32 model of ``base`` with ``adapter`` merged into its weights: W += scale * B @ A."""
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    config = json.loads((adapter / "adapter_config.json").read_text())
    rank = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(rank) if config["use_rslora"] else rank)
    tensors = load_file(adapter / "adapter_model.safetensors")
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                params[f"{module}.weight"] += scale * tensors[name.replace("lora_A", "lora_B")] @ a
    return hf


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]], adapters: list[LoRARequest | None] | LoRARequest | None,
            max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=adapters)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def family(request: pytest.FixtureRequest, tiny_checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """A base checkpoint, two adapters (every projection; q, v and down only, rsLoRA) and transformers' greedy
    tokens of each merged, and of the base model."""
    base = tiny_checkpoints[request.param]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    first = make_lora_adapter(base, root / "first", rank=8, seed=1)
    second = make_lora_adapter(base, root / "second", rank=4, alpha=8, seed=2, use_rslora=True,
                               targets=("q_proj", "v_proj", "down_proj"))
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompts = _prompts(hf_base.config.vocab_size, [5, 23, 12, 1])
    expected = {
        None: [hf_greedy(hf_base, p, MAX_NEW) for p in prompts],
        "first": [hf_greedy(merged_transformers(base, first), p, MAX_NEW) for p in prompts],
        "second": [hf_greedy(merged_transformers(base, second), p, MAX_NEW) for p in prompts],
    }
    adapters = {"first": LoRARequest("first", 1, str(first)), "second": LoRARequest("second", 2, str(second))}
    return base, prompts, expected, adapters


def test_an_adapters_greedy_tokens_are_transformers_with_it_merged(family) -> None:
    base, prompts, expected, adapters = family
    # not vacuous: each adapter moves some greedy tokens off the base model's
    assert expected["first"] != expected[None] and expected["second"] != expected[None]
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    for name in ("first", "second"):
        assert _greedy(llm, prompts, adapters[name]) == expected[name]
    assert _greedy(llm, prompts, None) == expected[None]
    assert_all_blocks_free(llm)


def test_a_batch_mixing_adapters_and_the_base_model_gives_each_rows_tokens(family) -> None:
    base = family[0]
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    names = ["first", None, "second", "first", None, "second", None, "first"]
    assert _adapters_per_step(llm, family, names) == 2  # both adapters, beside base-model rows, in one step
    assert_all_blocks_free(llm)


def _adapters_per_step(llm: LLM, family, names: list[str | None]) -> int:
    """Run a request per name (its adapter, None the base model; the family's prompts in turn), check each gives
    its reference tokens, and return the most adapters a step held."""
    _, prompts, expected, adapters = family
    steps: list[int] = []
    forward = llm.engine.core.runner._forward
    llm.engine.core.runner._forward = lambda batch: steps.append(len(batch.lora.groups) if batch.lora else 0) \
        or forward(batch)
    got = _greedy(llm, [prompts[i % len(prompts)] for i in range(len(names))],
                  [adapters[n] if n else None for n in names])
    assert got == [expected[n][i % len(prompts)] for i, n in enumerate(names)]
    return max(steps)


def test_samples_and_preempted_requests_keep_their_adapter(family) -> None:
    """n > 1 samples, forked from their request, and requests preempted and recomputed under a small KV cache run
    with the adapter they were sent with."""
    base, prompts, expected, adapters = family
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, n=3)
    out = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False, lora_request=adapters["first"])[0]
    assert [list(c.token_ids) for c in out.outputs] == [expected["first"][1]] * 3
    small = LLM(str(base), dtype="float32", num_kv_blocks=14, block_size=4, max_num_batched_tokens=16,
                enable_lora=True, max_loras=2)
    names = ["first", "second", None, "first"]
    assert _greedy(small, prompts, [adapters[n] if n else None for n in names]) == \
        [expected[n][i] for i, n in enumerate(names)]
    assert small.stats()["num_preemptions"] > 0
    assert_all_blocks_free(small)


def test_max_loras_holds_back_a_request_whose_adapter_would_be_one_too_many(family) -> None:
    base = family[0]
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=1)
    assert _adapters_per_step(llm, family, ["first", "second", None, "second", "first"]) == 1
    assert_all_blocks_free(llm)


def test_an_adapter_of_zeros_gives_the_base_models_tokens(family, tmp_path) -> None:
    base, prompts, expected, _ = family
    zeros = make_lora_adapter(base, tmp_path / "zeros", seed=3, zero_b=True)
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True)
    assert _greedy(llm, prompts, LoRARequest("zeros", 7, str(zeros))) == expected[None]


def test_the_prefix_cache_never_shares_blocks_across_adapters(tiny_checkpoints, tmp_path) -> None:
    """A prompt run with one adapter, then with the base model, the other adapter and the first again: only the
    last finds it cached. With the adapter left out of the blocks' key, the base model's run read the adapter's
    KV (a hit, and other tokens)."""
    base = tiny_checkpoints["llama"]
    first = LoRARequest("first", 1, str(make_lora_adapter(base, tmp_path / "first", seed=1)))
    second = LoRARequest("second", 2, str(make_lora_adapter(base, tmp_path / "second", seed=2)))
    prompt = _prompts(200, [40], seed=5)[0]
    alone = {name: _greedy(LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True), [prompt], adapter)
             for name, adapter in (("first", first), ("second", second), ("base", None))}
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, block_size=4, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    for adapter, name, cached in ((first, "first", 0), (None, "base", 0), (second, "second", 0), (first, "first", 36)):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=adapter)[0]
        assert out.outputs[0].token_ids == alone[name][0]
        assert out.num_cached_tokens == cached, name


def test_the_disk_tier_keys_blocks_by_the_adapters_content_not_its_name(tiny_checkpoints, tmp_path) -> None:
    """A restarted engine whose adapter changed behind the same name, id and path finds none of the old adapter's
    blocks on disk (and gives the new adapter's tokens); with the adapter unchanged it finds them."""
    base = tiny_checkpoints["llama"]
    adapter_dir = make_lora_adapter(base, tmp_path / "adapter", seed=1)
    adapter = LoRARequest("tuned", 1, str(adapter_dir))
    prompt = _prompts(200, [32], seed=6)[0]
    options = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "enable_lora": True,
               "kv_offload_dir": str(tmp_path / "kv")}

    def run() -> tuple[list[int], int]:
        llm = LLM(str(base), **options)
        tokens = _greedy(llm, [prompt], adapter)[0]
        stats = llm.stats()
        llm.engine.flush_kv_offload()
        llm.close()
        return tokens, stats["kv_offload_disk_hit_tokens"]

    old_tokens, _ = run()
    assert run() == (old_tokens, 28)  # the same adapter: its prompt's blocks (all but the last) came off disk
    shutil.rmtree(adapter_dir)
    make_lora_adapter(base, adapter_dir, seed=2)
    new_tokens, disk_hits = run()
    assert disk_hits == 0
    assert new_tokens == hf_greedy(merged_transformers(base, adapter_dir), prompt, MAX_NEW) != old_tokens


def test_an_adapter_with_lora_off_or_an_id_taken_by_another_adapter_is_refused(tiny_checkpoints, tmp_path) -> None:
    base = tiny_checkpoints["llama"]
    first = make_lora_adapter(base, tmp_path / "first", seed=1)
    other = make_lora_adapter(base, tmp_path / "other", seed=2)
    with pytest.raises(InvalidParameter, match="LoRA is off"):
        _greedy(LLM(str(base), dtype="float32", num_kv_blocks=16), [[5, 6]], LoRARequest("first", 1, str(first)))
    llm = LLM(str(base), dtype="float32", num_kv_blocks=16, enable_lora=True)
    _greedy(llm, [[5, 6]], LoRARequest("first", 1, str(first)))
    with pytest.raises(InvalidParameter, match="lora_int_id 1 is adapter 'first'"):
        _greedy(llm, [[5, 6]], LoRARequest("other", 1, str(other)))
    assert_all_blocks_free(llm)


def test_an_adapter_that_does_not_fit_the_model_is_refused_naming_it(tiny_checkpoints, tmp_path) -> None:
    """An adapter made for another model's shapes (a q_proj of one more input feature): refused as it loads,
    naming it and the module, nothing queued and nothing installed."""
    base = tiny_checkpoints["llama"]
    llm = LLM(str(base), dtype="float32", num_kv_blocks=16, enable_lora=True)
    foreign = make_lora_adapter(base, tmp_path / "foreign", seed=1)
    tensors = load_file(foreign / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:, :1]], dim=1)
    save_file(tensors, foreign / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="LoRA adapter 'foreign': model.layers.0.self_attn.q_proj's lora_A"):
        _greedy(llm, [[5, 6]], LoRARequest("foreign", 1, str(foreign)))
    assert not llm.engine.has_unfinished_requests()
    assert all(not layer.lora for layer, _ in llm.engine.core.runner.model.lora_projections().values())


def test_lora_refuses_what_it_does_not_combine_with(tiny_checkpoints) -> None:
    base = str(tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match="max_loras tune LoRA, which is off"):
        LLM(base, max_loras=2)
    with pytest.raises(ValueError, match="enable_lora with speculative_method='draft'"):
        LLM(base, enable_lora=True, speculative_method="draft", draft_model=base)


def test_cpu_step_graphs_replay_decodes_with_adapters(family) -> None:
    """Decode steps with adapters replay CPU step graphs (one per size and set of adapters) and give the eager
    tokens; a removed adapter's graphs go with it (they hold copies of its weights)."""
    base, prompts, expected, adapters = family
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    graphs = llm.engine.core.runner.graphs
    names = ["first", None, "second", "first"]
    assert _greedy(llm, prompts, [adapters[n] if n else None for n in names]) == \
        [expected[n][i] for i, n in enumerate(names)]
    assert _greedy(llm, prompts, adapters["first"]) == expected["first"]
    assert {adapter_ids for _, adapter_ids in graphs.graphs} >= {(1, 2), (1,)} and graphs.num_replays > 0
    llm.remove_lora(1)
    assert all(1 not in adapter_ids for _, adapter_ids in graphs.graphs)
    assert _greedy(llm, prompts, adapters["second"]) == expected["second"]
    assert _greedy(llm, prompts, LoRARequest("first-again", 3, adapters["first"].lora_path)) == expected["first"]
    assert_all_blocks_free(llm)
