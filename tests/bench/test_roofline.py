"""``kvserve bench roofline``: a model's size and FLOPs counted by hand, bounds from given rates, and a real
(tiny) measurement on CPU whose bounds follow from its own rates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvserve.bench.roofline import ModelSize, fraction_of_bound, request_flops, token_bounds, workload_flops
from kvserve.cli import main
from kvserve.model.loader import load_checkpoint
from kvserve.model.sources import resolve_model

# The tiny llama checkpoint's dimensions.
TINY = ModelSize(hidden=64, intermediate=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=512, tie_word_embeddings=False)
# Per layer: q and o 2 * 64 * 64, k and v 2 * 64 * 32, gate, up and down 3 * 64 * 128.
LINEAR = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # 73,728
LM_HEAD = 512 * 64  # 32,768


def test_model_size_is_read_from_the_checkpoint_config(tiny_checkpoint: Path) -> None:
    config = load_checkpoint(resolve_model(str(tiny_checkpoint)), torch.float32).hf_config
    assert ModelSize.from_hf_config(config) == TINY


def test_size_and_flops_counted_by_hand() -> None:
    assert TINY.linear_params_per_token == LINEAR
    assert TINY.params_per_token == LINEAR + LM_HEAD
    norms = (2 * 2 + 1) * 64
    assert TINY.num_params == LM_HEAD + LINEAR + LM_HEAD + norms  # embeddings + layers + untied head + norms
    assert TINY.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4
    assert TINY.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    # 3 prompt + 2 output tokens: 4 forward positions, 2 sampled rows, causal context 1 + 2 + 3 + 4
    expected = 2 * LINEAR * 4 + 2 * LM_HEAD * 2 + 4 * 2 * 4 * 16 * 10
    assert request_flops(TINY, 3, 2) == expected
    assert workload_flops(TINY, [(3, 2), (3, 2)]) == 2 * expected


def test_bounds_follow_from_given_rates() -> None:
    bounds = token_bounds(TINY, copy_bytes_per_s=4e9, gemm_flops_per_s=1e11, weight_dtype=torch.float32)
    assert bounds["decode_batch1_tokens_per_s"] == pytest.approx(4e9 / ((LINEAR + LM_HEAD) * 4))
    assert bounds["decode_large_batch_tokens_per_s"] == pytest.approx(1e11 / (2 * (LINEAR + LM_HEAD)))
    assert bounds["prefill_tokens_per_s"] == pytest.approx(1e11 / (2 * LINEAR))
    bf16 = token_bounds(TINY, copy_bytes_per_s=4e9, gemm_flops_per_s=1e11, weight_dtype=torch.bfloat16)
    assert bf16["decode_batch1_tokens_per_s"] == pytest.approx(2 * bounds["decode_batch1_tokens_per_s"])
    assert fraction_of_bound(30.0, 120.0) == 0.25


def test_roofline_on_cpu_measures_positive_rates_and_bounds_them(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    result_json = tmp_path / "roofline.json"
    assert main(["bench", "roofline", str(tiny_checkpoint), "--device", "cpu", "--copy-mib", "4", "--gemm-size",
                 "64", "--gemm-tokens", "16", "--num-repeats", "2", "--dtypes", "float32,bfloat16",
                 "--result-json", str(result_json)]) == 0
    result = json.loads(result_json.read_text())
    assert result["kind"] == "roofline" and result["copy_bytes_per_s"] > 0
    assert result["model"]["params_per_token"] == LINEAR + LM_HEAD
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        gemm = result["gemm"][name]
        rates = [shape["flops_per_s"] for shape in gemm["shapes"].values()]
        assert min(rates) > 0 and gemm["peak_flops_per_s"] == max(rates)
        assert gemm["shapes"]["qkv"]["shape"] == [16, 64, (4 + 2 * 2) * 16]
        expected = token_bounds(TINY, result["copy_bytes_per_s"], gemm["peak_flops_per_s"], dtype)
        assert result["bounds"][name] == pytest.approx(expected)
    printed = capsys.readouterr()
    assert "copy bandwidth" in printed.out and "bfloat16 weights" in printed.out
    assert "measuring float32 GEMMs ...\nmeasuring bfloat16 GEMMs ...\n" in printed.err  # progress, not silence


def test_by_default_the_roofline_measures_the_devices_run_dtype(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """bf16 as well took minutes of silence on a CPU without native bf16 (1.2 GFLOP/s on a Zen 3)."""
    result_json = tmp_path / "roofline.json"
    assert main(["bench", "roofline", str(tiny_checkpoint), "--device", "cpu", "--copy-mib", "4", "--gemm-size",
                 "64", "--gemm-tokens", "16", "--num-repeats", "1", "--result-json", str(result_json)]) == 0
    assert list(json.loads(result_json.read_text())["gemm"]) == ["float32"]


@pytest.mark.parametrize("flags, message", [
    (["--num-repeats", "0"], "--num-repeats must be >= 1, got 0"),
    (["--copy-mib", "0"], "--copy-mib must be >= 1, got 0"),
    (["--copy-mib", "-1"], "--copy-mib must be >= 1, got -1"),
    (["--gemm-size", "0"], "--gemm-size must be >= 1, got 0"),
    (["--gemm-tokens", "-5"], "--gemm-tokens must be >= 1, got -5"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--threads", "-1"], "--threads must be >= 1, got -1"),
    (["--dtypes", ","], "--dtypes ',' names no dtype"),
])
def test_probe_sizes_below_one_are_refused_naming_the_flag(tiny_checkpoint: Path, flags: list[str], message: str,
                                                           capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "roofline", str(tiny_checkpoint), "--device", "cpu", *flags]) == 2
    assert capsys.readouterr().err == f"kvserve: error: {message}\n"
