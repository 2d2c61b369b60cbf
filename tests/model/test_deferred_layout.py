"""Dense layouts laid out after start-up (``ModelConfig.dense_layouts_in_background``): the layers multiply their
blocks until their copy is there, the same dense path as a plain load afterwards; CPU step graphs recorded before
are recorded again; a layout that fails or is stopped leaves its layers on their blocks, never broken."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import EngineConfig, ModelConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.deferred_layout import DeferredLayouts
from kvserve.model.layers.ggml import GGMLLinearMethod, ggml_gemm
from kvserve.model.layers.linear import Linear
from kvserve.model.layers.prepacked import CpuPrepackedLinearMethod, small_gemm
from tests.model.test_ggml import blocks_of, packed_layer
from tests.model.test_loader import byte_level_tokens, tiny_llama, write_gguf

Q = gguf.GGMLQuantizationType


def deferred_method() -> GGMLLinearMethod:
    return GGMLLinearMethod(ggml_gemm(), CpuPrepackedLinearMethod(small_gemm()), defer_dense=True)


def two_layers() -> tuple[list[Linear], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(48, 64, generator=gen), torch.randn(32, 64, generator=gen)]
    layers = [packed_layer({"q_proj": blocks_of(w, Q.Q8_0)}, deferred_method()) for w in weights]
    return layers, [blocks_of(w, Q.Q8_0).dequantize() for w in weights]


def test_a_pending_layer_multiplies_its_blocks_until_its_dense_copy_is_laid_out() -> None:
    layers, dense = two_layers()
    model = torch.nn.ModuleList(layers)
    assert all(layer.pending_dense is not None for layer in layers)
    assert not any(name.endswith("weight") for name, _ in model.named_parameters())
    x = torch.randn(17, 64)
    before = [layer(x) for layer in layers]  # the strips kernel over the blocks
    layouts = DeferredLayouts.start(model)
    assert layouts is not None and layouts.wait(60) and layouts.error is None
    assert all(layer.pending_dense is None and layer.panels is not None for layer in layers)
    # the same parameters as before (a KV disk tier keys blocks by them)
    assert not any(name.endswith("weight") for name, _ in model.named_parameters())
    for layer, weight, y in zip(layers, dense, before):
        expected = x @ weight.T
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert DeferredLayouts.start(model) is None  # nothing left


def test_a_layout_that_fails_leaves_its_layers_on_their_blocks(monkeypatch, caplog) -> None:
    layers, dense = two_layers()
    lay_out = GGMLLinearMethod.lay_out_dense

    def failing(self, layer):
        if layer is layers[1]:
            raise MemoryError("no memory for the copy")
        lay_out(self, layer)

    monkeypatch.setattr(GGMLLinearMethod, "lay_out_dense", failing)
    with caplog.at_level(logging.WARNING):
        layouts = DeferredLayouts.start(torch.nn.ModuleList(layers))
        assert layouts.wait(60)
    assert isinstance(layouts.error, MemoryError) and "keep multiplying their GGUF blocks" in caplog.text
    assert layers[0].pending_dense is None and layers[1].pending_dense is not None
    x = torch.randn(9, 64)
    for layer, weight in zip(layers, dense):
        torch.testing.assert_close(layer(x), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_stopping_leaves_the_layers_not_reached_on_their_blocks(monkeypatch) -> None:
    layers, dense = two_layers()
    layouts = DeferredLayouts(layers)  # not started: stopped before its first layer
    layouts.stop()
    layouts._run()
    assert layouts.done and all(layer.pending_dense is not None for layer in layers)
    x = torch.randn(9, 64)
    torch.testing.assert_close(layers[0](x), x @ dense[0].T, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_llama(vocab_size=len(byte_level_tokens()[0]))
    return write_gguf(tmp_path_factory.mktemp("deferred") / "tiny-q8_0.gguf", model, qtype=Q.Q8_0)


def decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    return tokens


def test_an_engine_serves_before_its_layouts_land_and_records_its_step_graphs_again(q8_gguf: Path) -> None:
    """Six decodes a step run on the blocks (the strips kernel) while the layouts are pending, through a CPU step
    graph; once they land the graph is recorded again and greedy tokens equal a plain load's."""
    plain = LLMEngine(EngineConfig(model=ModelConfig(model=str(q8_gguf))))
    deferred = LLMEngine(EngineConfig(model=ModelConfig(model=str(q8_gguf), dense_layouts_in_background=True)))
    runner = deferred.core.runner
    assert runner.layouts is not None
    assert deferred.stats()["weights_bytes"] < plain.stats()["weights_bytes"]  # the copies are not there yet
    # hold the layouts back until the first requests are served
    layouts, runner.layouts = runner.layouts, None
    prompts = [[5, 9, 30 + i, 31, 40, 7 + i] for i in range(6)]
    assert decode(deferred, prompts, 4).keys() == {f"r{i}" for i in range(6)}
    recorded = runner.graphs.graphs[6, ()]
    assert layouts.wait(60) and layouts.error is None
    runner.layouts = layouts
    others = [[11 + i, 3, 50, 8 + i, 2] for i in range(6)]  # no prefix of the first ones: KV of the blocks' run
    assert decode(deferred, others, 8) == decode(plain, others, 8)
    assert runner.layouts is None and runner.graphs.graphs[6, ()] is not recorded  # recorded again, after them
    assert deferred.stats()["weights_bytes"] == plain.stats()["weights_bytes"]
