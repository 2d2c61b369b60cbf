"""LoRA adapters as read (PEFT's format, each unimplemented field refused naming the adapter and the field) and
as applied by a layer: a step's rows grouped by adapter get ``x @ (W + scale * B @ A).T``, packed projections
included, the rows of other adapters and of none untouched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvserve.model.layers.linear import Linear, PackedLinear, UnquantizedLinearMethod
from kvserve.model.layers import lora
from kvserve.model.layers.lora import MASKED_MAX_TOKENS, LoRAGroup, LoRAMapping, install_adapter
from kvserve.model.lora_adapter import LoRAAdapter, LoRAAdapterError, read_lora_adapter
from kvserve.model.lora_checkpoint import make_lora_adapter
from tests.model.test_loader import gguf_file, gguf_model  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def adapter_dir(tiny_checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora_adapter(tiny_checkpoints["llama"], tmp_path_factory.mktemp("lora") / "adapter", rank=4,
                             alpha=8, targets=("q_proj", "down_proj"))


def _with_config(adapter_dir: Path, tmp_path: Path, **changes) -> Path:
    copy = tmp_path / "changed"
    copy.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text()) | changes
    (copy / "adapter_config.json").write_text(json.dumps(config))
    (copy / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    return copy


def test_an_adapter_reads_its_rank_scale_and_each_modules_pair(adapter_dir: Path) -> None:
    adapter = read_lora_adapter(adapter_dir, "mine", max_rank=16)
    assert (adapter.rank, adapter.scale) == (4, 2.0)
    assert set(adapter.weights) == {f"model.layers.{i}.{m}" for i in range(2)
                                    for m in ("self_attn.q_proj", "mlp.down_proj")}
    a, b = adapter.weights["model.layers.0.self_attn.q_proj"]
    assert a.shape[0] == 4 and b.shape[1] == 4
    assert read_lora_adapter(adapter_dir, "other name", max_rank=16).digest == adapter.digest


@pytest.mark.parametrize(("changes", "message"), [
    ({"modules_to_save": ["lm_head"]}, "field 'modules_to_save'"),
    ({"bias": "all"}, "field 'bias': 'all'"),
    ({"use_dora": True}, "field 'use_dora': DoRA"),
    ({"rank_pattern": {"q_proj": 8}}, "field 'rank_pattern'"),
    ({"target_modules": ["q_proj", "lm_head", "embed_tokens"]}, "field 'target_modules': 'lm_head', 'embed_tokens'"),
    ({"r": 32}, "field 'r': rank 32 is above max_lora_rank=16"),
    ({"peft_type": "IA3"}, "field 'peft_type'"),
    ({"use_rslora": "false"}, "field 'use_rslora': must be true or false, got 'false'"),
    ({"init_lora_weights": "pissa_niter_4"}, "field 'init_lora_weights': 'pissa_niter_4' trains the adapter over"),
    ({"init_lora_weights": "olora"}, "field 'init_lora_weights': 'olora'"),
])
def test_what_is_not_implemented_is_refused_naming_the_adapter_and_field(adapter_dir: Path, tmp_path: Path,
                                                                        changes: dict, message: str) -> None:
    with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'mine': adapter_config.json {message}"):
        read_lora_adapter(_with_config(adapter_dir, tmp_path, **changes), "mine", max_rank=16)


def test_an_embedding_tensor_a_lone_half_or_no_safetensors_file_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    changed = _with_config(adapter_dir, tmp_path)
    weights = changed / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({**tensors, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}, weights)
    with pytest.raises(LoRAAdapterError, match="tensor 'base_model.model.model.embed_tokens.lora_embedding_A'"):
        read_lora_adapter(changed, "mine", max_rank=16)
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.down_proj.lora_B" not in k}, weights)
    with pytest.raises(LoRAAdapterError, match="model.layers.1.mlp.down_proj has no lora_B.weight"):
        read_lora_adapter(changed, "mine", max_rank=16)
    weights.rename(changed / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match=r"no adapter_model.safetensors .* \(adapter_model.bin, a pickle"):
        read_lora_adapter(changed, "mine", max_rank=16)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_tensor_holding_nan_or_inf_is_refused_naming_it(adapter_dir: Path, tmp_path: Path, value: float) -> None:
    """Served, one NaN made every logit of the adapter's rows NaN: token 0 over and over, NaN logprobs."""
    changed = _with_config(adapter_dir, tmp_path)
    weights = changed / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    tensors[name][3, 1] = value
    save_file(tensors, weights)
    with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'mine': tensor '{name}' holds NaN or infinite values"):
        read_lora_adapter(changed, "mine", max_rank=16)


@pytest.mark.parametrize("masked_max_tokens", [0, MASKED_MAX_TOKENS], ids=["grouped", "masked"])
def test_a_packed_layers_rows_get_their_adapters_term_and_no_other(masked_max_tokens: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v packed; adapter 1 targets q and v, adapter 2 k, adapter 3 another layer: rows 0 and 3 run adapter 1,
    row 2 adapter 2, row 1 the base layer, row 4 adapter 3; by groups of rows and by the masked GEMM pair (a step
    of few tokens), the stacks kept on the layer made again when an adapter is installed."""
    monkeypatch.setattr(lora, "MASKED_MAX_TOKENS", masked_max_tokens)
    torch.manual_seed(0)
    layer = PackedLinear(6, {"q_proj": 4, "k_proj": 2, "v_proj": 2}, bias=True)
    layer.bind(UnquantizedLinearMethod(), torch.float32)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    projections = {f"p.{shard}": (layer, shard) for shard in layer.shards}
    pairs = {"q_proj": (torch.randn(3, 6), torch.randn(4, 3)), "v_proj": (torch.randn(3, 6), torch.randn(2, 3)),
             "k_proj": (torch.randn(3, 6), torch.randn(2, 3))}
    first = LoRAAdapter("first", Path(), 3, 0.5, "d1", {f"p.{s}": pairs[s] for s in ("q_proj", "v_proj")})
    second = LoRAAdapter("second", Path(), 3, 2.0, "d2", {"p.k_proj": pairs["k_proj"]})
    install_adapter(projections, 1, first, torch.float32, torch.device("cpu"))
    install_adapter(projections, 2, second, torch.float32, torch.device("cpu"))
    x = torch.randn(5, 6)
    mapping = LoRAMapping.of_tokens(np.array([1, 0, 2, 1, 3]), torch.device("cpu"))
    assert (mapping.token_groups is not None) == bool(masked_max_tokens)
    got = layer(x, mapping)

    def merged(adapter: LoRAAdapter) -> torch.Tensor:
        weight = layer.weight.clone()
        for module, (a, b) in adapter.weights.items():
            weight[layer.shard_rows()[module.removeprefix("p.")]] += adapter.scale * b @ a
        return weight

    want = torch.stack([F.linear(x[0], merged(first), layer.bias), F.linear(x[1], layer.weight, layer.bias),
                        F.linear(x[2], merged(second), layer.bias), F.linear(x[3], merged(first), layer.bias),
                        F.linear(x[4], layer.weight, layer.bias)])
    torch.testing.assert_close(got, want)
    every_row = LoRAMapping((LoRAGroup(2, None),))
    torch.testing.assert_close(layer(x, every_row), F.linear(x, merged(second), layer.bias))
    # adapter 2's weights replaced under its id: the next step's stack is the new one's
    install_adapter(projections, 2, first, torch.float32, torch.device("cpu"))
    again = layer(x, LoRAMapping.of_tokens(np.array([1, 0, 2, 1, 3]), torch.device("cpu")))
    torch.testing.assert_close(again[2], F.linear(x[2], merged(first), layer.bias))


def test_an_adapter_is_made_for_a_gguf_file_as_for_its_checkpoint(gguf_file: Path, gguf_model, tmp_path: Path) -> None:
    """``make_lora_adapter`` (and ``kvserve make-lora``) takes a model as ``kvserve serve`` does: a GGUF file's
    settings read as its loader reads them (transformers' config reader, which wants a directory, went to the
    Hub for one)."""
    adapter = read_lora_adapter(make_lora_adapter(gguf_file, tmp_path / "adapter", rank=4), "g", max_rank=16)
    config = gguf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    a, b = adapter.weights["model.layers.0.self_attn.k_proj"]
    assert a.shape == (4, config.hidden_size) and b.shape == (config.num_key_value_heads * head_dim, 4)
    assert len(adapter.weights) == 7 * config.num_hidden_layers


def test_an_id_installed_again_keeps_none_of_its_old_adapters_weights() -> None:
    """The old adapter under the id targeted two layers, the new one the first only: the second layer runs the base
    weights for it, not the old adapter's term (nor a stack of it kept for the masked path)."""
    torch.manual_seed(0)
    layers = [Linear(6, 4, bias=False) for _ in range(2)]
    for layer in layers:
        layer.bind(UnquantizedLinearMethod(), torch.float32)
    projections = {"p.a": (layers[0], None), "p.b": (layers[1], None)}
    pair = (torch.randn(3, 6), torch.randn(4, 3))
    old = LoRAAdapter("old", Path(), 3, 1.0, "d1", {"p.a": pair, "p.b": pair})
    install_adapter(projections, 1, old, torch.float32, torch.device("cpu"))
    install_adapter(projections, 2, old, torch.float32, torch.device("cpu"))
    x = torch.randn(2, 6)
    masked = LoRAMapping.of_tokens(np.array([1, 2]), torch.device("cpu"))
    layers[1](x, masked)  # a stack of ids 1 and 2 kept on the second layer
    install_adapter(projections, 1, LoRAAdapter("new", Path(), 3, 1.0, "d2", {"p.a": pair}), torch.float32,
                    torch.device("cpu"))
    assert 1 not in layers[1].lora
    with_old = F.linear(x[1], layers[1].weight) + pair[1] @ (pair[0] @ x[1])
    torch.testing.assert_close(layers[1](x, masked), torch.stack([F.linear(x[0], layers[1].weight), with_old]))
