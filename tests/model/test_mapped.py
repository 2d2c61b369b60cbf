"""``load_format="mmap"`` on safetensors checkpoints: every family runs from the file's mapped pages (no copy of a
weight, packed projections apart) and agrees with ``auto``; start-up does not read the file; what would copy a
weight is refused, saying why."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.model.checkpoint import ARCHITECTURES, make_checkpoint
from kvserve.model.loader import load_checkpoint
from kvserve.model.weight_format import weight_format
from kvserve.model.sources import ModelLocation
from tests.model.test_ggml import mapped_ranges

PROMPTS = [{"prompt_token_ids": [5, 9, 30, 31, 40] * 7}, {"prompt_token_ids": [7] * 3}]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


def weights_file(directory: Path) -> Path:
    return directory / "model.safetensors"


def mapping_kib(path: Path) -> dict[str, int]:
    """``/proc/self/smaps``'s sizes (kB) summed over this process's mappings of ``path``: ``Size`` mapped, ``Rss``
    in this process's page tables, ``Anonymous`` copied on write (no longer the file's pages)."""
    totals, inside, name = {"Size": 0, "Rss": 0, "Anonymous": 0}, False, str(path.resolve())
    for line in Path("/proc/self/smaps").read_text().splitlines():
        field, _, rest = line.partition(" ")
        if not field.endswith(":"):  # a mapping's first line: its range, ..., its file
            inside = line.endswith(name)
        elif inside and field[:-1] in totals:
            totals[field[:-1]] += int(rest.split()[0])
    return totals


def assert_in_file(tensors: list[torch.Tensor], path: Path) -> None:
    ranges = mapped_ranges(path)
    for tensor in tensors:
        start, stop = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        assert any(low <= start and stop <= high for low, high in ranges), f"{tuple(tensor.shape)} is a copy"


def assert_same_greedy(expected: list, got: list, atol: float) -> None:
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose([next(iter(s.values())).logprob for s in b.outputs[0].logprobs],
                                   [next(iter(s.values())).logprob for s in a.outputs[0].logprobs], atol=atol)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_load_format_mmap_runs_each_family_from_the_mapped_file_and_agrees_with_auto(
    arch: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """Every linear weight and the embeddings (a tied head's with them) lie in this process's mapping of the
    file; qkv and gate_up keep their projections apart. Greedy tokens equal auto's (prompts of 35 and 3 tokens
    together, CPU step graphs on), logprobs within fp32 rounding (auto multiplies prepacked copies, in another
    order of sums). Running writes no page of the file (none copied on write): processes share them all."""
    directory = tiny_checkpoints[arch]
    auto = LLM(str(directory), num_kv_blocks=64).generate(PROMPTS, GREEDY)
    mapped = LLM(str(directory), num_kv_blocks=64, load_format="mmap")
    assert mapped.stats()["weights_format"] == "float32 (mapped)"
    # the file's tensors less a tied head the file does not store, plus the small copied ones (norms, biases)
    assert 0.95 < mapped.stats()["weights_bytes"] / weights_file(directory).stat().st_size <= 1
    model = mapped.engine.core.runner.model
    attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert len(attention.qkv_proj.mapped_parts) == 3 and len(mlp.gate_up_proj.mapped_parts) == 2
    assert attention.qkv_proj.weight.numel() == 0  # no joined copy beside the parts
    linears = [tensor for layer in model.layers for packed in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)
               for tensor in packed.mapped_parts]
    linears += [layer.self_attn.o_proj.weight for layer in model.layers] + [layer.mlp.down_proj.weight
                                                                            for layer in model.layers]
    assert_in_file([*linears, model.embed_tokens.weight, model.lm_head.weight], weights_file(directory))
    assert model.tied == (model.lm_head.weight is model.embed_tokens.weight)
    assert_same_greedy(auto, mapped.generate(PROMPTS, GREEDY), atol=1e-4)
    assert mapping_kib(weights_file(directory))["Anonymous"] == 0


def test_load_format_mmap_starts_without_reading_the_file(tmp_path: Path) -> None:
    """A file out of the page cache (as after a reboot): loading it mapped brings in only the first pages of
    each tensor (safetensors' reader touches those; measured 1.9 of 13 MB), not the weights."""
    directory = make_checkpoint(tmp_path / "llama", "llama", "small", seed=0)
    fd = os.open(weights_file(directory), os.O_RDONLY)
    try:
        os.fsync(fd)  # written pages are dropped only once clean
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    llm = LLM(str(directory), num_kv_blocks=16, load_format="mmap")
    mapping = mapping_kib(weights_file(directory))
    assert mapping["Size"] * 1024 >= weights_file(directory).stat().st_size
    assert mapping["Rss"] < mapping["Size"] / 2 and mapping["Anonymous"] == 0
    assert llm.stats()["weights_format"] == "float32 (mapped)"


def test_load_format_mmap_maps_a_bfloat16_checkpoint_run_in_bfloat16(tiny_checkpoints: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    directory = shutil.copytree(tiny_checkpoints["qwen2"], tmp_path / "qwen2-bf16")
    tensors = {name: tensor.to(torch.bfloat16) for name, tensor in load_file(weights_file(directory)).items()}
    save_file(tensors, weights_file(directory), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="load_format='mmap' .*stores bfloat16 tensors and the model runs in "
                                         "float32: a cast copies them \\(dtype='bfloat16' maps them\\)"):
        LLM(str(directory), num_kv_blocks=64, load_format="mmap")
    auto = LLM(str(directory), num_kv_blocks=64, dtype="bfloat16").generate(PROMPTS, GREEDY)
    mapped = LLM(str(directory), num_kv_blocks=64, dtype="bfloat16", load_format="mmap")
    assert mapped.stats()["weights_format"] == "bfloat16 (mapped)"
    model = mapped.engine.core.runner.model
    assert_in_file([model.embed_tokens.weight, *model.layers[1].mlp.gate_up_proj.mapped_parts],
                   weights_file(directory))
    assert_same_greedy(auto, mapped.generate(PROMPTS, GREEDY), atol=0.05)


@pytest.mark.parametrize("options, reason", [
    ({"dtype": "bfloat16"}, "the checkpoint stores float32 tensors and the model runs in bfloat16: a cast copies"),
    ({"quantization": "int8"}, "quantization='int8' lays the weights out anew at load"),
    ({"quantization": "fp8"}, "quantization='fp8' lays the weights out anew at load"),
    ({"quantization": "gguf"}, "quantization='gguf' keeps a GGUF's blocks, and this checkpoint is not a GGUF"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 shards dense weights"),
])
def test_load_format_mmap_refuses_what_would_copy_a_weight(tiny_checkpoints: dict[str, Path], options: dict,
                                                           reason: str) -> None:
    with pytest.raises(ValueError, match=f"load_format='mmap' runs a safetensors checkpoint's tensors from the "
                                         f"mapped file; {reason}.*use load_format='auto'"):
        LLM(str(tiny_checkpoints["llama"]), num_kv_blocks=64, load_format="mmap", **options)


def test_load_format_mmap_refuses_a_device_other_than_the_cpu(tiny_checkpoints: dict[str, Path]) -> None:
    checkpoint = load_checkpoint(ModelLocation("hf_dir", tiny_checkpoints["llama"], "llama"), torch.float32)
    with pytest.raises(ValueError, match="load_format='mmap' .*device cuda holds its own copy"):
        weight_format("auto", checkpoint, torch.device("cuda"), torch.float32, dtype_forced=False,
                      load_format="mmap")
