"""make_checkpoint: seeded, loadable by transformers, with a matching tokenizer, chat template and eos."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from kvserve.model.checkpoint import ARCHITECTURES, SHAPES, make_checkpoint, make_config_only
from tests.model.conftest import Family, random_prompt


def same_tensors(a: Path, b: Path) -> bool:
    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_same_seed_same_checkpoint_other_seed_other_weights(arch: str, tmp_path: Path) -> None:
    first = make_checkpoint(tmp_path / "first", arch, seed=7)
    again = make_checkpoint(tmp_path / "again", arch, seed=7)
    other = make_checkpoint(tmp_path / "other", arch, seed=8)
    assert same_tensors(first, again)
    assert (first / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert not same_tensors(first, other)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokenizer_config_and_generation_config_agree(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    directory = tiny_checkpoints[arch]
    config = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    generation = json.loads((directory / "generation_config.json").read_text())
    assert config.vocab_size == len(tokenizer) == 512
    assert config.dtype == torch.float32
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["eos_token_id"] == config.eos_token_id == tokenizer.eos_token_id == eos
    assert {tokenizer.bos_token, tokenizer.pad_token} == {"<|begin_of_text|>", "<|pad|>"}


def test_tokenizer_round_trips_text_and_renders_chat(tiny_checkpoints: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])
    text = "The quick brown fox asks: what is 42?"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) < len(text)  # merges were learned
    assert tokenizer.decode(ids) == text
    messages = [{"role": "user", "content": "Hi"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_small_size_has_the_larger_vocabulary(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path / "small", "llama", size="small")
    config = AutoConfig.from_pretrained(directory)
    assert config.vocab_size == len(AutoTokenizer.from_pretrained(directory)) == 2048
    assert config.hidden_size == 256


def test_unknown_arch_or_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown architecture 'gpt2'.*llama, qwen2"):
        make_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="unknown checkpoint size 'huge'.*tiny, small"):
        make_checkpoint(tmp_path, "llama", size="huge")


def test_greedy_decoding_is_decisive(families: dict[str, Family]) -> None:
    """Top-1 and top-2 logits stay apart by 10x the fp32 difference between implementations (~1e-5 here), so
    greedy-equality tests do not hinge on rounding."""
    for family in families.values():
        for seed in range(2):
            prompt = random_prompt(family.vocab_size, 12, seed=seed)
            with torch.no_grad():
                out = family.hf.generate(
                    torch.tensor([prompt]), max_new_tokens=24, do_sample=False, output_scores=True,
                    return_dict_in_generate=True,
                )
            top2 = torch.stack(out.scores)[:, 0].topk(2).values
            assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, (family.arch, seed)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_config_only_writes_the_published_shape_and_no_weights(shape: str, tmp_path: Path) -> None:
    out = make_config_only(tmp_path / shape, shape)
    config = AutoConfig.from_pretrained(out)
    published = SHAPES[shape][1]
    assert {name: getattr(config, name) for name in published if name != "rope_parameters"} == {
        name: value for name, value in published.items() if name != "rope_parameters"}
    assert config.rope_parameters["rope_theta"] == published["rope_parameters"]["rope_theta"]
    assert not list(out.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == config.vocab_size and config.eos_token_id == tokenizer.eos_token_id


def test_config_only_tokenizer_encodes_as_the_tiny_one_and_decodes_every_id(tiny_checkpoints: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """Its vocabulary is padded to the model's: random weights sample text from any id, as a real model does."""
    padded = AutoTokenizer.from_pretrained(make_config_only(tmp_path / "s", "smollm2-135m"))
    tiny = AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])
    text = "The quick brown fox, 1234 jumps! Ünïcode"
    assert padded.encode(text) == tiny.encode(text)
    assert padded.decode([len(tiny), 49151]) == f" w{len(tiny)} w49151"
    assert padded.decode(tiny.encode(text)) == text


def test_an_unknown_shape_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown shape 'gpt-5'"):
        make_config_only(tmp_path, "gpt-5")
