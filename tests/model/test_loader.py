"""load_checkpoint: safetensors (single and sharded) and GGUF, dtype casting, stop tokens, broken checkpoints."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvserve import LLM
from kvserve.model.base import CheckpointError
from kvserve.model.layers.ggml import GGMLTensor
from kvserve.model.loader import Checkpoint, load_checkpoint
from kvserve.model.sources import ModelLocation, resolve_model
from tests.conftest import greedy_token_ids, hf_greedy

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"


def tiny_llama(vocab_size: int = 64, dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    config = LlamaConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 1,
        "eos_token_id": 2, **overrides,
    })
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def save_tokenizer(directory: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=CHAT_TEMPLATE
    )
    tokenizer.save_pretrained(directory)


def save_hf_dir(directory: Path, model: LlamaForCausalLM, **save_kwargs) -> Path:
    model.save_pretrained(directory, **save_kwargs)
    save_tokenizer(directory)
    (directory / "generation_config.json").unlink(missing_ok=True)
    return directory


def hf_location(directory: Path) -> ModelLocation:
    return ModelLocation("hf_dir", directory, directory.name)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory: pytest.TempPathFactory, model: LlamaForCausalLM) -> Path:
    return save_hf_dir(tmp_path_factory.mktemp("single"), model)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory, model: LlamaForCausalLM) -> Path:
    return save_hf_dir(tmp_path_factory.mktemp("sharded"), model, max_shard_size="40KB")


def copy_dir(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / source.name))


# ---- safetensors ---------------------------------------------------------------------------------------------


def test_single_file_yields_the_models_tensors(single_dir: Path, model: LlamaForCausalLM) -> None:
    checkpoint = load_checkpoint(hf_location(single_dir), torch.float32)
    weights = dict(checkpoint.weights())
    state = model.state_dict()
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[name], state[name]) for name in state)


def test_sharded_yields_the_same_tensors_as_single_file(single_dir: Path, sharded_dir: Path) -> None:
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(sharded_dir.glob("*.safetensors"))) > 2
    single = dict(load_checkpoint(hf_location(single_dir), torch.float32).weights())
    sharded = dict(load_checkpoint(hf_location(sharded_dir), torch.float32).weights())
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[name], single[name]) for name in single)


def test_metadata(single_dir: Path) -> None:
    checkpoint = load_checkpoint(hf_location(single_dir), torch.float32)
    assert checkpoint.hf_config.architectures == ["LlamaForCausalLM"]
    assert checkpoint.hf_config.num_hidden_layers == 2
    assert checkpoint.max_model_len == 256
    assert checkpoint.tokenizer.chat_template == CHAT_TEMPLATE
    assert checkpoint.tokenizer("w1 w2")["input_ids"] == [4, 5]
    assert checkpoint.eos_token_ids == frozenset({2})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_cast_to_the_load_dtype(single_dir: Path, model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    weights = dict(load_checkpoint(hf_location(single_dir), dtype).weights())
    assert {tensor.dtype for tensor in weights.values()} == {dtype}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights[name], model.state_dict()[name].to(dtype))


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sources_load_as_fp32(tmp_path: Path, source_dtype: torch.dtype) -> None:
    half = tiny_llama(dtype=source_dtype)
    weights = dict(load_checkpoint(hf_location(save_hf_dir(tmp_path, half)), torch.float32).weights())
    name = "model.embed_tokens.weight"
    assert weights[name].dtype == torch.float32
    assert torch.equal(weights[name], half.state_dict()[name].float())


def test_missing_architectures_are_filled_from_the_model_type(tmp_path: Path, single_dir: Path) -> None:
    directory = copy_dir(single_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    del config["architectures"]
    (directory / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(hf_location(directory), torch.float32).hf_config.architectures == ["LlamaForCausalLM"]


# ---- stop tokens ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eos, expected", [([2, 7, 9], {2, 7, 9}), (7, {7})])
def test_eos_ids_come_from_generation_config_first(tmp_path: Path, single_dir: Path, eos, expected) -> None:
    directory = copy_dir(single_dir, tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert load_checkpoint(hf_location(directory), torch.float32).eos_token_ids == frozenset(expected)


@pytest.mark.parametrize("eos", ["abc", 64, -5, [2, "x"], True])
def test_eos_ids_that_are_no_token_ids_of_the_vocabulary_are_refused(tmp_path: Path, single_dir: Path, eos) -> None:
    """A string was taken for its characters (the model never stopped at its EOS), an id past the vocabulary failed
    every step that asked for min_tokens, a list of mixed kinds failed at load with a TypeError."""
    directory = copy_dir(single_dir, tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert_load_fails(directory, str(directory), f"the generation_config.json's eos_token_id must be a token id, or "
                                                 f"a list of them, in [0, 64); got {eos!r}")


def test_eos_ids_fall_back_to_the_tokenizer(tmp_path: Path, single_dir: Path) -> None:
    directory = copy_dir(single_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = None
    (directory / "config.json").write_text(json.dumps(config))
    checkpoint = load_checkpoint(hf_location(directory), torch.float32)
    assert checkpoint.hf_config.eos_token_id is None
    assert checkpoint.eos_token_ids == frozenset({checkpoint.tokenizer.convert_tokens_to_ids("</s>")})


# ---- broken Hugging Face directories -------------------------------------------------------------------------


def assert_load_fails(directory: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(hf_location(directory), torch.float32)
    for fragment in fragments:
        assert fragment in str(error.value)


@pytest.mark.parametrize("change, fragment", [
    ({"vocab_size": 2**31}, "vocab_size is 2147483648, but model.embed_tokens.weight holds 64 rows"),
    ({"intermediate_size": 2**40}, "intermediate_size is 1099511627776, but model.layers.0.mlp.gate_proj.weight holds"),
    ({"num_hidden_layers": 100_000}, "num_hidden_layers says 100000 layers, its tensors hold 2"),
    ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ({"num_key_value_heads": 0}, "num_key_value_heads (0)"),
    ({"hidden_size": "64"}, "transformers cannot build a config from it"),
    ({"dtype": "banana"}, "transformers cannot build a config from it"),  # transformers' AttributeError
    ({"head_dim": 2**31}, "num_attention_heads x head_dim is 8589934592, but model.layers.0.self_attn.q_proj.weight "
                          "holds 64 rows"),
    ({"hidden_size": 2**31}, "hidden_size is 2147483648, but model.layers.0.self_attn.o_proj.weight holds 64 rows"),
    ({"head_dim": 8}, "num_attention_heads x head_dim is 32, but model.layers.0.self_attn.q_proj.weight holds 64"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number, got -1.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
     "rope_theta must be a positive number, got 0.0"),
])
def test_a_config_that_disagrees_with_the_tensors_fails_before_any_memory_is_spent(
        tmp_path: Path, single_dir: Path, change: dict, fragment: str) -> None:
    """Models are built from their config: a vocabulary of 2^31 tokens was allocated (512 GB) before a shape
    was compared; a mistyped field escaped as huggingface_hub's own error."""
    directory = copy_dir(single_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | change))
    assert_load_fails(directory, str(directory / "config.json"), fragment)


@pytest.mark.parametrize("head_differs", [True, False])
def test_a_tied_checkpoint_that_stores_another_head_is_untied_as_transformers_does(
    tmp_path: Path, head_differs: bool
) -> None:
    tied = tiny_llama(tie_word_embeddings=True)
    directory = save_hf_dir(tmp_path / "tied", tied)
    tensors = load_file(directory / "model.safetensors")
    embeddings = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = torch.randn_like(embeddings) if head_differs else embeddings.clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    checkpoint = load_checkpoint(hf_location(directory), torch.float32)
    assert checkpoint.hf_config.tie_word_embeddings is not head_differs
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    llm = LLM(str(directory), dtype="float32", num_kv_blocks=16)
    prompt = [5, 9, 14, 3, 22]
    assert greedy_token_ids(llm, [prompt], 8)[0][0] == hf_greedy(hf, prompt, 8)


def test_a_tied_checkpoint_that_stores_only_its_head_is_named_missing_its_embeddings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = save_hf_dir(tmp_path / "head-only", tiny_llama(tie_word_embeddings=True))
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.embed_tokens\.weight"):
        LLM(str(directory), dtype="float32", num_kv_blocks=16)
    assert "differs" not in caplog.text


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_weight_stored_as_integers_or_booleans_is_refused(tmp_path: Path, single_dir: Path, dtype) -> None:
    """It was cast to values it never held and served."""
    directory = copy_dir(single_dir, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = (tensors[name] * 1000).to(dtype)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    assert_load_fails(directory, f"tensor {name} is stored as {'I32' if dtype == torch.int32 else 'BOOL'}")


def test_a_tensor_stored_in_two_files_is_refused(tmp_path: Path, single_dir: Path) -> None:
    """The later file's copy silently won."""
    directory = copy_dir(single_dir, tmp_path)
    save_file({"model.norm.weight": torch.full((64,), 7.0)}, directory / "z.safetensors", metadata={"format": "pt"})
    assert_load_fails(directory, "z.safetensors holds model.norm.weight, which model.safetensors holds too")


def test_directory_without_config_json(tmp_path: Path, single_dir: Path) -> None:
    directory = copy_dir(single_dir, tmp_path)
    (directory / "config.json").unlink()
    assert_load_fails(directory, str(directory), "no config.json")


def test_config_json_that_is_not_json(tmp_path: Path, single_dir: Path) -> None:
    directory = copy_dir(single_dir, tmp_path)
    (directory / "config.json").write_text('{"model_type": "llama",')
    assert_load_fails(directory, str(directory / "config.json"), "not valid JSON")


def test_index_naming_a_missing_shard(tmp_path: Path, sharded_dir: Path) -> None:
    directory = copy_dir(sharded_dir, tmp_path)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert_load_fails(directory, "model.safetensors.index.json", "missing", shard.name)


def test_truncated_safetensors(tmp_path: Path, single_dir: Path) -> None:
    directory = copy_dir(single_dir, tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert_load_fails(directory, str(weights), "truncated or corrupt")


def test_corrupt_safetensors(tmp_path: Path, single_dir: Path) -> None:
    directory = copy_dir(single_dir, tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + bytes(64))
    assert_load_fails(directory, str(weights), "truncated or corrupt")


def test_directory_without_safetensors(tmp_path: Path, single_dir: Path) -> None:
    directory = copy_dir(single_dir, tmp_path)
    (directory / "model.safetensors").unlink()
    assert_load_fails(directory, str(directory), "no .safetensors")


def test_missing_tokenizer_files(tmp_path: Path, single_dir: Path) -> None:
    directory = copy_dir(single_dir, tmp_path)
    (directory / "tokenizer.json").unlink()
    assert_load_fails(directory, str(directory), "no tokenizer files")


# ---- GGUF ----------------------------------------------------------------------------------------------------


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter gives Q and K (rotary halves interleaved), which loading undoes."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def byte_level_tokens() -> tuple[list[str], list[str]]:
    # two merges: transformers 5.17 reads a GGUF string array of one entry as that string
    tokens = list(bytes_to_unicode().values()) + ["ĠĠ", "ĠĠĠ", "<|endoftext|>"]
    return tokens, ["Ġ Ġ", "ĠĠ Ġ"]


def write_gguf(
    path: Path, model: LlamaForCausalLM, arch: str = "llama", qtype: gguf.GGMLQuantizationType | None = None,
    blocks: Mapping[str, GGMLTensor] | None = None, block_count: int | None = None,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write ``model`` as llama.cpp's converter would (GGUF names, permuted Q/K): F32 tensors, or its 2-D ones
    quantized to ``qtype`` by gguf's reference quantizer; the tensors ``blocks`` names (by their Hugging Face
    names) as those blocks instead, written as they are (rows in the file's order). ``block_count``: metadata
    that says another number of layers than the tensors hold. ``extra`` writes more metadata and tensors."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers if block_count is None else block_count)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    tokens, merges = byte_level_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if "q_proj" in hf_name:
            tensor = llama_cpp_permute(tensor, config.num_attention_heads)
        elif "k_proj" in hf_name:
            tensor = llama_cpp_permute(tensor, config.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if blocks and hf_name in blocks:
            writer.add_tensor(name, blocks[hf_name].blocks.numpy(), raw_dtype=blocks[hf_name].qtype)
        elif qtype is not None and tensor.dim() == 2:
            writer.add_tensor(name, gguf.quants.quantize(tensor.numpy(), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, tensor.numpy())
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_model() -> LlamaForCausalLM:
    return tiny_llama(vocab_size=len(byte_level_tokens()[0]))


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory, gguf_model: LlamaForCausalLM) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gguf_model)


def gguf_location(path: Path) -> ModelLocation:
    return ModelLocation("gguf", path, path.name)


def test_gguf_round_trips_to_the_hf_tensors(gguf_file: Path, gguf_model: LlamaForCausalLM) -> None:
    weights = dict(load_checkpoint(gguf_location(gguf_file), torch.float32).weights())
    state = gguf_model.state_dict()
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[name], state[name]) for name in state)


def test_gguf_metadata(gguf_file: Path, gguf_model: LlamaForCausalLM) -> None:
    checkpoint = load_checkpoint(gguf_location(gguf_file), torch.bfloat16)
    config = checkpoint.hf_config
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert config.vocab_size == gguf_model.config.vocab_size
    assert checkpoint.max_model_len == 256
    assert checkpoint.eos_token_ids == frozenset({config.vocab_size - 1})
    assert checkpoint.tokenizer.chat_template == CHAT_TEMPLATE
    assert checkpoint.tokenizer.decode(checkpoint.tokenizer("hi  there")["input_ids"]) == "hi  there"
    assert {tensor.dtype for _, tensor in checkpoint.weights()} == {torch.bfloat16}


def assert_gguf_fails(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(gguf_location(path), torch.float32)
    for fragment in (str(path), *fragments):
        assert fragment in str(error.value)


@pytest.mark.parametrize("keep", [0.5, 0.99])  # cut inside the metadata, and inside the tensor data
def test_truncated_gguf(tmp_path: Path, gguf_file: Path, keep: float) -> None:
    data = gguf_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: 2000 if keep < 0.9 else int(len(data) * keep)])
    assert_gguf_fails(cut, "truncated or corrupt")


def test_corrupt_gguf(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"NOTAGGUF" + bytes(100))
    assert_gguf_fails(corrupt, "truncated or corrupt")


def test_a_gguf_this_user_may_not_read_is_named_so_not_called_corrupt(gguf_file: Path, monkeypatch) -> None:
    """A second user of a cache someone else pulled into was told the file was "truncated or corrupt". (Tests
    run as root, whom a file's mode does not stop: the refusal is the OS's error, raised as it would be.)"""
    from kvserve.model import loader

    def refused(path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(loader, "load_gguf_index", refused)
    monkeypatch.setattr("transformers.integrations.gguf.read_gguf_metadata", refused)
    with pytest.raises(PermissionError, match="Permission denied"):
        load_checkpoint(gguf_location(gguf_file), torch.float32)


@pytest.mark.parametrize("block_count, fragment", [
    (1_000_000, "llama.block_count says 1000000 layers, its tensors hold 2"),
    (0, "llama.block_count must be a positive number of layers, got 0"),
])
def test_a_gguf_whose_block_count_disagrees_with_its_tensors(tmp_path: Path, gguf_model: LlamaForCausalLM,
                                                             block_count: int, fragment: str) -> None:
    """Checked before the meta model is built: a million layers took minutes and gigabytes to fail, named as a
    truncated file; none dropped the file's layers and failed deep in the engine."""
    assert_gguf_fails(write_gguf(tmp_path / "blocks.gguf", gguf_model, block_count=block_count), fragment)


def test_a_gguf_tensor_of_a_type_gguf_cannot_dequantize_is_refused_before_loading(
        tmp_path: Path, gguf_model: LlamaForCausalLM) -> None:
    """It failed after the model was built, with gguf's NotImplementedError naming no file or tensor."""
    name = "model.layers.0.self_attn.q_proj.weight"
    q8_1 = GGMLTensor(torch.zeros(64, 2 * 40, dtype=torch.uint8), gguf.GGMLQuantizationType.Q8_1, (64, 64))
    path = write_gguf(tmp_path / "q8_1.gguf", gguf_model, blocks={name: q8_1})
    assert_gguf_fails(path, "tensor blk.0.attn_q.weight is of ggml type Q8_1, which kvserve cannot read")


def test_gguf_of_an_architecture_transformers_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_gguf_fails(path, "architecture 'bert'", "cannot read")


# ---- the real packaged GGUFs (slow: about 100 and 250 MB) ----------------------------------------------------


def assert_equals_transformers(path: Path) -> Checkpoint:
    start = time.perf_counter()
    checkpoint = load_checkpoint(gguf_location(path), torch.float32)
    weights = dict(checkpoint.weights())
    print(f"kvserve load of {path.name}: {time.perf_counter() - start:.1f} s")
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    state = reference.state_dict()
    assert set(state) - set(weights) <= {"lm_head.weight"}  # tied: the file stores no output matrix
    assert weights.keys() <= state.keys()
    assert all(torch.equal(weights[name], state[name]) for name in weights)
    return checkpoint


@pytest.mark.slow
def test_real_smollm2_gguf_equals_transformers() -> None:
    checkpoint = assert_equals_transformers(resolve_model("smollm2-135m-instruct").path)
    assert checkpoint.hf_config.architectures == ["LlamaForCausalLM"]
    assert checkpoint.hf_config.tie_word_embeddings
    assert checkpoint.tokenizer.chat_template
    assert checkpoint.eos_token_ids == frozenset({checkpoint.tokenizer.convert_tokens_to_ids("<|im_end|>")})


@pytest.mark.slow
def test_real_gemma3_gguf_equals_transformers() -> None:
    checkpoint = assert_equals_transformers(resolve_model("gemma-3-270m").path)
    assert checkpoint.hf_config.architectures == ["Gemma3ForCausalLM"]
    assert checkpoint.max_model_len == 32768
