"""``--cpu-offload-gb``: the weight streamer's choice of layers and its slot rotation, run on the CPU with
synchronous copies (the same hooks a GPU runs, its streams aside), against the resident model; on a GPU, the
engine with offload against the engine without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.checkpoint import make_checkpoint
from kvserve.model.offload import layer_bytes, offload_weights

PROMPTS = [{"prompt_token_ids": [5, 9, 30, 31, 40, 41, 42]}, {"prompt_token_ids": [7] * 20}]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("five-layers")
    return {arch: make_checkpoint(root / arch, arch, "tiny", seed=1, num_layers=5) for arch in ("llama", "gemma3")}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_streamed_layers_give_the_resident_models_tokens(five_layers, family: str) -> None:
    """Three of five layers offloaded: they take turns in the two slots (0, 1, 0) every step."""
    llm = LLM(str(five_layers[family]), num_kv_blocks=64, dtype="bfloat16", enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    model = llm.engine.core.runner.model
    per_layer = layer_bytes(model.layers[0])
    streamer = offload_weights(model.layers, torch.device("cpu"), int(3.5 * per_layer))
    assert streamer is not None and streamer.num_offloaded == 3  # whole layers within the budget
    offloaded = model.layers[-3:]
    assert all(p.numel() == 0 for layer in offloaded for p in layer.parameters())  # the loaded copies dropped
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    # after a step each offloaded layer points into a slot, never at its host copy
    slot_ptrs = {t.data_ptr() for slot in streamer.slots for t in slot}
    host_ptrs = {t.data_ptr() for layer in streamer.host for t in layer}
    for layer in offloaded:
        assert {p.data_ptr() for p in layer.parameters()} <= slot_ptrs
        assert not {p.data_ptr() for p in layer.parameters()} & host_ptrs


def test_a_budget_under_one_layer_offloads_nothing_and_the_first_layer_stays(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), num_kv_blocks=16, dtype="bfloat16", enforce_eager=True)
    layers = llm.engine.core.runner.model.layers
    per_layer = layer_bytes(layers[0])
    assert offload_weights(layers, torch.device("cpu"), per_layer - 1) is None
    streamer = offload_weights(layers, torch.device("cpu"), 100 * per_layer)
    assert streamer.num_offloaded == len(layers) - 1  # the first layer starts each step's first copy


def test_cpu_offload_on_cpu_leaves_the_weights_where_they_are(tiny_checkpoints, caplog) -> None:
    with caplog.at_level("WARNING"):  # a flag that changes nothing is heard at the default level
        llm = LLM(str(tiny_checkpoints["llama"]), num_kv_blocks=16, cpu_offload_gb=1.0)
    assert "nothing to offload" in caplog.text
    assert llm.engine.core.runner.model.weight_streamer is None


def test_cpu_offload_is_refused_with_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match="cpu_offload_gb is not supported"):
        LLM("unused", cpu_offload_gb=1.0, tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_engine_equals_the_resident_one_on_a_gpu(tiny_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1, 1))  # as if the weights did not fit
    path = str(tiny_checkpoints["llama"])
    resident = LLM(path, num_kv_blocks=64, device="cuda")
    offloaded = LLM(path, num_kv_blocks=64, device="cuda", cpu_offload_gb=0.5)
    assert offloaded.engine.core.runner.model.weight_streamer.num_offloaded >= 1
    assert ([o.outputs[0].token_ids for o in offloaded.generate(PROMPTS, PARAMS)]
            == [o.outputs[0].token_ids for o in resident.generate(PROMPTS, PARAMS)])
