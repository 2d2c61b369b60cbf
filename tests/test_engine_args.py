"""EngineArgs: one definition of the engine's options behind LLM(...), serve, bench throughput and generate;
configs frozen after validation; no global seeding."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.cli import build_parser
from kvserve.config import (
    ATTENTION_BACKEND_ENV_VAR,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvserve.engine_args import EngineArgs

# A value other than the default for every option, and how it is written on a command line.
CHANGED = {
    "model": "some-model",
    "dtype": "bfloat16",
    "quantization": "none",
    "quantize_activations": True,
    "enforce_eager": True,
    "attention_backend": "torch_ref",
    "chat_template": "{{ messages[0].content }}",
    "generation_config": "vllm",
    "max_logprobs": 5,
    "logprobs_mode": "processed_logprobs",
    "load_format": "mmap",
    "cpu_offload_gb": 2.5,
    "max_model_len": 512,
    "seed": 7,
    "device": "cpu",
    "block_size": 32,
    "num_kv_blocks": 99,
    "kv_cache_memory": 1.5,
    "gpu_memory_utilization": 0.5,
    "kv_cache_dtype": "int8",
    "enable_prefix_caching": False,
    "kv_offload_memory": 0.5,
    "kv_offload_dir": "/tmp/kv-blocks",
    "kv_offload_disk": 2.0,
    "max_num_seqs": 3,
    "max_num_batched_tokens": 64,
    "scheduling_policy": "fcfs",
    "lpm_aging_steps": 5,
    "preemption_mode": "swap",
    "overlap_scheduling": False,
    "speculative_method": "ngram",
    "num_speculative_tokens": 5,
    "ngram_min": 2,
    "ngram_max": 6,
    "tensor_parallel_size": 2,
    "distributed_executor_backend": "ray",
    "draft_model": "some-draft-model",
    "enable_lora": True,
    "max_loras": 3,
    "max_lora_rank": 32,
    "runner": "pooling",
    "pooling_type": "MEAN",
    "pooling_normalize": False,
}


def _flags(skip: tuple[str, ...] = (), model_flag: bool = False) -> list[str]:
    argv = []
    for name, value in CHANGED.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "model" and not model_flag:
            argv.insert(0, value)
        elif isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def test_the_changed_values_cover_every_option() -> None:
    assert set(CHANGED) == {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize(
    "command, skip, model_flag",
    [
        (["serve"], (), False),
        (["bench", "throughput"], ("seed",), False),  # --seed is the workload's there, and seeds the engine too
        (["generate", "a prompt"], (), True),
    ],
)
def test_every_command_takes_every_engine_option(command, skip, model_flag) -> None:
    args = build_parser().parse_args(command + _flags(skip, model_flag) + (["--seed", "7"] if skip else []))
    assert EngineArgs.from_cli_args(args) == EngineArgs(**CHANGED)


def test_defaults_are_the_configs_defaults() -> None:
    assert EngineArgs().create_engine_config() == EngineConfig()
    assert build_parser().parse_args(["serve"]).max_num_seqs == SchedulerConfig.max_num_seqs


def test_flat_options_land_in_the_narrow_configs() -> None:
    # KV offload keeps prefix-cache blocks: the changed values it cannot go with are caching off and (not yet)
    # tensor parallelism, whose option lands in the test below; a draft model goes with the draft method only
    # (test_draft_options_land_in_the_speculative_config), lpm's aging with lpm only (the test below), and
    # speculation with a runner that generates
    config = EngineArgs(**{**CHANGED, "enable_prefix_caching": True, "tensor_parallel_size": 1,
                           "draft_model": None, "lpm_aging_steps": None, "runner": "auto"}).create_engine_config()
    assert config.model == ModelConfig("some-model", "bfloat16", 512, 7, "none", True, True, "mmap", 2.5,
                                       attention_backend="torch_ref", chat_template="{{ messages[0].content }}",
                                       generation_config="vllm", max_logprobs=5,
                                       logprobs_mode="processed_logprobs", runner="auto", pooling_type="MEAN",
                                       pooling_normalize=False)
    assert config.cache == CacheConfig(32, 99, 1.5, 0.5, True, "int8", 0.5, "/tmp/kv-blocks", 2.0)
    assert config.scheduler == SchedulerConfig(3, 64, SchedulerConfig.max_model_len, "fcfs",
                                               SchedulerConfig.lpm_aging_steps, "swap", False)
    assert config.speculative == SpeculativeConfig("ngram", 5, 2, 6)
    assert config.lora == LoRAConfig(True, 3, 32)
    assert config.device == "cpu"


def test_lpm_aging_lands_under_lpm_and_is_refused_under_fcfs() -> None:
    aging = CHANGED["lpm_aging_steps"]
    assert EngineArgs(lpm_aging_steps=aging).create_engine_config().scheduler.lpm_aging_steps == aging
    with pytest.raises(ValueError, match="lpm_aging_steps tunes scheduling_policy='lpm', not 'fcfs'"):
        EngineArgs(scheduling_policy="fcfs", lpm_aging_steps=aging).create_engine_config()


def test_tensor_parallel_options_land_in_the_parallel_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's backend is checked to be installed with the configuration (vLLM's ParallelConfig checks so too):
    installed, as far as the check can tell, here."""
    import importlib.machinery
    import types

    ray = types.ModuleType("ray")
    ray.__spec__ = importlib.machinery.ModuleSpec("ray", None)
    monkeypatch.setitem(sys.modules, "ray", ray)
    config = EngineArgs(tensor_parallel_size=CHANGED["tensor_parallel_size"],
                        distributed_executor_backend=CHANGED["distributed_executor_backend"]).create_engine_config()
    assert config.parallel == ParallelConfig(2, "ray")


@pytest.mark.parametrize(
    "options, named",
    [
        ({"speculative_method": "medusa"}, "speculative_method"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"speculative_method": "ngram", "ngram_min": 0}, "ngram_min .* must be >= 1"),
        ({"speculative_method": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_max .* must be >= ngram_min"),
        ({"num_speculative_tokens": 3}, "num_speculative_tokens tune speculation, which is off"),
        ({"ngram_min": 1, "ngram_max": 3}, "ngram_min, ngram_max tune speculation, which is off"),
        ({"speculative_method": "draft", "draft_model": "x", "ngram_min": 1}, "ngram_min tune .*'ngram', not 'draft'"),
        ({"speculative_method": "draft"}, "--draft-model"),
        ({"speculative_method": "ngram", "draft_model": "x"}, "draft_model"),
        ({"draft_model": "x"}, "draft_model"),
        ({"speculative_method": "draft", "draft_model": "x", "kv_offload_memory": 1.0}, "kv_offload_memory"),
        ({"speculative_method": "draft", "draft_model": "x", "kv_offload_dir": "/tmp/x"}, "kv_offload_dir"),
        ({"speculative_method": "draft", "draft_model": "x", "tensor_parallel_size": 2}, "speculative_method='draft'"),
    ],
)
def test_bad_speculative_options_name_the_option(options, named) -> None:
    with pytest.raises(ValueError, match=named):
        EngineArgs(**options).create_engine_config()


@pytest.mark.parametrize(
    "options, named",
    [
        ({"kv_offload_memory": 0.0}, "kv_offload_memory"),
        ({"kv_offload_disk": -1.0}, "kv_offload_disk"),
        ({"kv_offload_dir": ""}, "kv_offload_dir"),
        ({"kv_offload_dir": "/tmp/x", "enable_prefix_caching": False}, "prefix caching"),
        ({"kv_offload_memory": 1.0, "enable_prefix_caching": False}, "preemption_mode='swap'"),
        ({"preemption_mode": "swap"}, "--preemption-mode swap --kv-offload-memory"),
        ({"preemption_mode": "swap", "kv_offload_dir": "/tmp/x"}, "kv_offload_memory"),
        ({"preemption_mode": "pause"}, "preemption_mode"),
    ],
)
def test_bad_kv_offload_options_name_the_option(options, named) -> None:
    with pytest.raises(ValueError, match=named):
        EngineArgs(**options).create_engine_config()


def test_swap_takes_a_host_tier_with_or_without_prefix_caching() -> None:
    for caching in (True, False):
        config = EngineArgs(preemption_mode="swap", kv_offload_memory=0.5,
                            enable_prefix_caching=caching).create_engine_config()
        assert config.scheduler.preemption_mode == "swap" and config.cache.kv_offload_memory == 0.5


def test_vllm_speculative_config_maps_to_the_flat_options() -> None:
    options = EngineArgs.config_dict_options("speculative_config", {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert EngineArgs(**options).create_engine_config().speculative == SpeculativeConfig("ngram", 4, 1, 3)
    with pytest.raises(ValueError, match="draft_model"):
        EngineArgs.config_dict_options("speculative_config", {"method": "ngram", "draft_model": "x"})


def test_draft_options_land_in_the_speculative_config() -> None:
    options = EngineArgs.config_dict_options("speculative_config",
                                             {"method": "draft", "model": "small", "num_speculative_tokens": 5})
    assert options == {"speculative_method": "draft", "draft_model": "small", "num_speculative_tokens": 5}
    assert EngineArgs(**options).create_engine_config().speculative == SpeculativeConfig("draft", 5, model="small")


@pytest.mark.parametrize("config", [ModelConfig(), CacheConfig(), SchedulerConfig(), EngineConfig()])
def test_configs_are_frozen(config) -> None:
    name = dataclasses.fields(config)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, name, getattr(config, name))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"dtype": "float64"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 6}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"scheduling_policy": "random"}, "scheduling_policy"),
        ({"lpm_aging_steps": 0}, "lpm_aging_steps"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_logprobs": -2}, "max_logprobs must be -1 .the whole vocabulary. or >= 0"),
        ({"logprobs_mode": "logprobs"}, "unknown logprobs_mode 'logprobs'"),
    ],
)
def test_a_bad_value_is_refused_before_anything_loads(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options).create_engine_config()


def test_a_forced_attention_backend_comes_from_the_option_else_the_environment(
    tiny_checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ATTENTION_BACKEND_ENV_VAR, raising=False)
    assert EngineArgs().create_engine_config().model.attention_backend is None
    monkeypatch.setenv(ATTENTION_BACKEND_ENV_VAR, "torch_ref")
    assert EngineArgs().create_engine_config().model.attention_backend == "torch_ref"
    assert EngineArgs(attention_backend="cpu_paged").create_engine_config().model.attention_backend == "cpu_paged"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV_VAR, "flash")
    with pytest.raises(ValueError, match=r"\$KVSERVE_ATTENTION_BACKEND='flash' names no attention backend"):
        EngineArgs().create_engine_config()  # no flag was given: the variable is named
    monkeypatch.delenv(ATTENTION_BACKEND_ENV_VAR)
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=16, attention_backend="torch_ref")
    assert type(llm.engine.core.runner.backend) is TorchRefBackend


def test_an_unknown_llm_option_is_named() -> None:
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM("any-model", max_num_sequences=4)


def test_building_an_engine_leaves_the_global_rng_alone(tiny_checkpoints) -> None:
    before = torch.get_rng_state()
    LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=16, seed=1234)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_numpy_integer_seeds_the_engine_as_the_same_int_does(tiny_checkpoints) -> None:
    """It passed the seed's check, then the first unseeded draw raised OverflowError inside the step."""
    params = SamplingParams(temperature=1.0, max_tokens=6)
    draws = [LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=16, seed=seed).generate(
        [{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[0].outputs[0].token_ids
        for seed in (np.int64(3), 3)]
    assert draws[0] == draws[1] and len(draws[0]) == 6


def test_a_disk_tier_size_without_its_directory_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_offload_disk sizes the disk tier.*kv_offload_dir"):
        EngineArgs(kv_offload_disk=1.0).create_engine_config()
    config = EngineArgs(kv_offload_dir="/tmp/kv-blocks").create_engine_config()
    assert config.cache.disk_tier_bytes == 16 * 2**30


@pytest.mark.parametrize("options, message", [
    ({"num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer, got str '3'"),
    ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer, got float 2.5"),
    ({"kv_cache_memory": "1"}, "kv_cache_memory must be a number"),
    ({"enforce_eager": "no"}, "enforce_eager must be True or False"),
    ({"dtype": None}, "dtype must be a string, got NoneType"),
])
def test_an_option_of_the_wrong_kind_is_refused_by_name(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)


@pytest.mark.parametrize("option", ["quantization", "max_num_seqs", "max_num_batched_tokens",
                                    "enable_prefix_caching", "seed", "block_size", "distributed_executor_backend"])
def test_none_means_our_default_where_vllm_defaults_to_none(option: str) -> None:
    """A vLLM script passes ``quantization=None`` for "whatever the checkpoint holds"; it was refused as not a
    string."""
    assert getattr(EngineArgs(**{option: None}), option) == getattr(EngineArgs(), option)


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bfloat16"), (torch.float32, "float32"),
                                         (torch.float16, "float16")])
def test_a_torch_dtype_is_taken_by_its_name(dtype: torch.dtype, name: str) -> None:
    args = EngineArgs(dtype=dtype)
    assert args.dtype == name and args.create_engine_config().model.dtype == name


@pytest.mark.parametrize("field", ["kv_cache_memory", "kv_offload_memory", "kv_offload_disk"])
@pytest.mark.parametrize("gib", [float("nan"), float("inf"), 1e300, 0.0, -1.0])
def test_a_memory_budget_is_a_finite_number_of_gib(field: str, gib: float) -> None:
    """NaN passed the ``<= 0`` check and failed after the model loaded, in an ``int()`` naming nothing."""
    extra = {"kv_offload_dir": "/nonexistent"} if field == "kv_offload_disk" else {}
    with pytest.raises(ValueError, match=re.escape(f"{field} must be a finite number of GiB > 0, got {gib}")):
        CacheConfig(**{field: gib}, **extra)


@pytest.mark.parametrize("gib", [float("nan"), float("inf"), -1.0])
def test_weight_offload_is_a_finite_number_of_gib(gib: float) -> None:
    with pytest.raises(ValueError, match="cpu_offload_gb must be a finite number of GiB >= 0"):
        ModelConfig(cpu_offload_gb=gib)


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70, 1.5, "3", True])
def test_the_engines_seed_is_a_64_bit_signed_integer_as_a_requests_is(seed: object) -> None:
    """2**64 and -2**64 drew as seed 0 does (folded into 64 bits); SamplingParams refused them already."""
    with pytest.raises(ValueError, match=re.escape(f"seed must be a 64-bit signed integer, got {seed!r}")):
        ModelConfig(seed=seed)
    assert ModelConfig(seed=2**63 - 1).seed == 2**63 - 1 and ModelConfig(seed=-(2**63)).seed == -(2**63)


def test_a_chat_template_is_a_files_text_or_the_template_itself(tmp_path) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert EngineArgs(chat_template=str(path)).create_engine_config().model.chat_template == template
    assert EngineArgs(chat_template=template).create_engine_config().model.chat_template == template
    assert EngineArgs().create_engine_config().model.chat_template is None
    with pytest.raises(ValueError, match="chat_template: .*neither a file nor a Jinja template"):
        EngineArgs(chat_template=str(tmp_path / "missing.jinja")).create_engine_config()


def test_generation_config_takes_vllms_two_names_only() -> None:
    assert EngineArgs().create_engine_config().model.generation_config == "auto"
    with pytest.raises(ValueError, match="unknown generation_config '/some/folder'; expected one of auto, vllm"):
        EngineArgs(generation_config="/some/folder").create_engine_config()



def test_vllm_pooler_config_folds_into_the_flat_options() -> None:
    config = EngineArgs(**EngineArgs.with_config_dicts(
        {"pooler_config": {"pooling_type": "CLS", "normalize": False}})).create_engine_config()
    assert (config.model.pooling_type, config.model.pooling_normalize) == ("CLS", False)
    with pytest.raises(ValueError, match="pooling_type='MEAN' and pooler_config's 'CLS' disagree"):
        EngineArgs.with_config_dicts({"pooling_type": "MEAN", "pooler_config": {"pooling_type": "CLS"}})
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["m", "--pooler-config", '{"pooling_type": "MEAN"}']))
    assert args.pooling_type == "MEAN"
