"""Seeded random checkpoints of every supported family, written with transformers' own classes.

A checkpoint is a Hugging Face directory: config.json and model.safetensors (fp32), a byte-level BPE tokenizer
trained offline on a small built-in English corpus (with a ChatML chat template), and generation_config.json.
Every tensor, norms and biases included, is drawn from the seed, so that a loader that swaps two norms or drops
a bias is caught by comparing against transformers. The init scale spreads the logits (std about 2): the top two
logits of a greedy step are typically 0.4 apart and rarely under 1e-3, against about 1e-5 of fp32 difference
between implementations, so greedy-equality tests do not hinge on rounding.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PAD, BOS, IM_START, EOS = "<|pad|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>"
# AutoTokenizer loads a qwen2 checkpoint with Qwen2Tokenizer, which adds <|endoftext|> unless the vocab has it
SPECIAL_TOKENS = (PAD, BOS, IM_START, EOS, "<|endoftext|>")  # ids 0 .. 4
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
INIT_STD = 0.25  # weights and biases ~ N(0, INIT_STD)
NORM_STD = 0.1  # norm weights ~ 1 + N(0, NORM_STD) (Gemma: N(0, NORM_STD), its norms scale by 1 + weight)


@dataclass(frozen=True)
class _Size:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    sliding_window: int  # small for tiny, so that prompts of a few dozen tokens cross it

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


_SIZES = {
    "tiny": _Size(512, 64, 128, 2, 4, 2, 512, 12),
    "small": _Size(2048, 256, 512, 4, 8, 4, 2048, 64),
    "tiny-1kv": _Size(512, 64, 128, 2, 4, 1, 512, 12),  # one KV head: replicated under tensor parallelism
}
SIZES = tuple(_SIZES)


# Published models' configurations (their Hugging Face config.json, the fields kvserve reads), for measuring speed
# at real sizes with ``--load-format dummy`` on a machine that cannot download the weights
SHAPES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "smollm2-135m": (LlamaConfig, dict(  # HuggingFaceTB/SmolLM2-135M-Instruct
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "llama3-8b": (LlamaConfig, dict(  # meta-llama/Meta-Llama-3-8B
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "llama3.2-1b": (LlamaConfig, dict(  # meta-llama/Llama-3.2-1B
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2.5-7b": (Qwen2Config, dict(  # Qwen/Qwen2.5-7B-Instruct
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def make_config_only(out_dir: str | Path, shape: str) -> Path:
    """Write ``shape``'s published config with no weights, and the tiny checkpoints' tokenizer with its vocabulary
    padded to the model's (``_pad_vocabulary``): a directory ``--load-format dummy`` runs at that model's real
    size, and every token its random weights sample is text, as a real model's would be (a served benchmark
    times the chunks of text that stream back)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
    out_dir = _made_dir(out_dir)
    weights = sorted(path.name for path in out_dir.glob("*.safetensors"))
    if weights:
        raise ValueError(f"{out_dir} holds weights ({', '.join(weights)}): a config written beside them would load "
                         "as a broken model; choose an empty directory")
    config_class, fields = SHAPES[shape]
    tokenizer = _train_tokenizer(_SIZES["tiny"].vocab_size, pad_to=fields["vocab_size"])
    special_ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id}
    config = config_class(**fields, **special_ids)
    config.architectures = [_FAMILIES["qwen2" if config_class is Qwen2Config else "llama"][1]]
    config.save_pretrained(out_dir)
    GenerationConfig(**special_ids).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_checkpoint(
    out_dir: str | Path, arch: str, size: str = "tiny", seed: int = 0, num_layers: int | None = None
) -> Path:
    """Write a seeded random ``arch`` checkpoint of ``size`` to ``out_dir`` and return its path; ``num_layers``
    overrides the size's (a draft model for speculation: same tokenizer, fewer layers).

    The same (arch, size, seed, num_layers) always gives the same tensors and tokenizer.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise ValueError(f"unknown checkpoint size {size!r}; expected one of {', '.join(SIZES)}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    out_dir = _made_dir(out_dir)
    shape = _SIZES[size] if num_layers is None else replace(_SIZES[size], num_layers=num_layers)
    tokenizer = _train_tokenizer(shape.vocab_size)
    model = _random_model(arch, shape, tokenizer, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _made_dir(out_dir: str | Path) -> Path:
    """``out_dir``, made first: a path that cannot be a folder raises its OSError before the tokenizer is trained
    (and transformers' ``save_pretrained`` only logs a file in the way and writes nothing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


# ---- tokenizer -------------------------------------------------------------------------------------------


def _train_tokenizer(vocab_size: int, pad_to: int | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens trained on the corpus; ``pad_to``: its vocabulary then padded to
    that many ids (``_pad_vocabulary``)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_text(), trainer)
    if pad_to is not None:
        bpe = _pad_vocabulary(bpe, pad_to)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )


def _pad_vocabulary(bpe: Tokenizer, vocab_size: int) -> Tokenizer:
    """``bpe`` with ids from its vocabulary's end up to ``vocab_size`` made tokens of their own (" w<id>"): no merge
    produces them, so encoding is unchanged, and each decodes to text."""
    spec = json.loads(bpe.to_str())
    vocab = spec["model"]["vocab"]
    for token_id in range(len(vocab), vocab_size):
        vocab[f"\u0120w{token_id}"] = token_id  # U+0120: byte-level BPE's character for a space
    return Tokenizer.from_str(json.dumps(spec))


def _training_text() -> list[str]:
    # upper-cased lines and numbers give the trainer enough distinct words for the small vocabulary
    numbers = " ".join(str(n) for n in range(0, 1000, 7))
    return [*CORPUS, *(line.upper() for line in CORPUS), numbers]


# ---- model -----------------------------------------------------------------------------------------------


def _random_model(arch: str, size: _Size, tokenizer: PreTrainedTokenizerFast, seed: int) -> PreTrainedModel:
    special_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    make_config, class_name = _FAMILIES[arch]
    config = make_config(size, len(tokenizer), special_ids)
    model_class = getattr(importlib.import_module("transformers"), class_name)
    model = model_class(config).to(torch.float32)
    randomize(model, seed)
    model.generation_config = GenerationConfig(**special_ids)
    return model


def randomize(model: PreTrainedModel, seed: int) -> None:
    """Draw every parameter of a transformers model of a supported family from ``seed``.

    Norm weights scatter around 1 (Gemma: around 0, as its norms scale by 1 + weight). Embeddings stay small
    next to the layers' outputs (Gemma multiplies them by sqrt(hidden_size)): embeddings that swamp the
    residual stream make a tied LM head predict its input token forever.
    """
    is_gemma = model.config.model_type == "gemma3_text"
    norm_offset = 0.0 if is_gemma else 1.0
    embed_std = INIT_STD / model.config.hidden_size**0.5 if is_gemma else INIT_STD
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            module = name.rsplit(".", 2)[-2]
            if "norm" in module:
                param.copy_(norm_offset + NORM_STD * noise)
            else:
                param.copy_((embed_std if module == "embed_tokens" else INIT_STD) * noise)


def _common(size: _Size, vocab_size: int, special_ids: dict[str, int]) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=size.max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=INIT_STD,
        **special_ids,
    )


def _llama_config(size: _Size, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
    # Llama 3.1's rope scaling, with an original context short enough that all its frequency bands occur
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": size.max_position_embeddings // 8,
    }
    return LlamaConfig(**_common(size, vocab_size, special_ids), rope_parameters=rope, tie_word_embeddings=False)


def _qwen2_config(size: _Size, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    return Qwen2Config(**_common(size, vocab_size, special_ids), rope_parameters=rope, tie_word_embeddings=True)


def _qwen3_config(size: _Size, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
    # like the real Qwen3 models, a head_dim that is not hidden_size / num_heads
    return Qwen3Config(
        **_common(size, vocab_size, special_ids), head_dim=2 * size.head_dim, tie_word_embeddings=True
    )


def _mistral_config(size: _Size, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
    return MistralConfig(
        **_common(size, vocab_size, special_ids), sliding_window=size.sliding_window, tie_word_embeddings=False
    )


def _gemma3_config(size: _Size, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
    layer_types = ["full_attention" if i % 2 else "sliding_attention" for i in range(size.num_layers)]
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 4.0},
    }
    return Gemma3TextConfig(
        **_common(size, vocab_size, special_ids),
        head_dim=size.head_dim,
        query_pre_attn_scalar=2 * size.head_dim,  # not head_dim, so that using the wrong scale shows
        sliding_window=size.sliding_window,
        layer_types=layer_types,
        rope_parameters=rope,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    )


# each family's config and, by name, its transformers class: transformers' modeling modules take seconds to
# import, and `kvserve serve` imports this module's names for its command line
_FAMILIES: dict[str, tuple[Callable[..., PretrainedConfig], str]] = {
    "llama": (_llama_config, "LlamaForCausalLM"),
    "qwen2": (_qwen2_config, "Qwen2ForCausalLM"),
    "qwen3": (_qwen3_config, "Qwen3ForCausalLM"),
    "mistral": (_mistral_config, "MistralForCausalLM"),
    "gemma3": (_gemma3_config, "Gemma3ForCausalLM"),
}
ARCHITECTURES = tuple(_FAMILIES)

CORPUS = (
    'The quick brown fox jumps over the lazy dog while the farmer watches from the porch.',
    'Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter.',
    'Every morning they walked down to the harbour, mended their nets and talked about the weather.',
    'The river runs through the valley, past the mill, under the stone bridge and out to the open sea.',
    'Scientists measure the speed of light, the mass of the electron and the age of distant galaxies.',
    'A computer program is a list of instructions that tells the machine what to do, step by step.',
    'Good software is tested, documented and reviewed before it is released to its users.',
    'The engine reads the prompt, splits it into tokens and computes the next token again and again.',
    'Memory is a scarce resource, so the cache keeps the keys and values of recent tokens in blocks.',
    'In the spring the orchard is white with blossom; in the autumn the branches bend under the apples.',
    'She opened the window, breathed the cold air and listened to the birds singing in the garden.',
    'History teaches us that cities rise and fall, that empires grow and crumble, and that people endure.',
    'Mathematics is the language of patterns: numbers, shapes, functions, proofs and beautiful ideas.',
    'The library was quiet except for the turning of pages and the soft ticking of the clock on the wall.',
    'He cooked a simple dinner of bread, cheese, tomatoes and olives, and shared it with his neighbours.',
    'Travellers crossed the mountains in winter, following narrow paths between the snow and the clouds.',
    'The teacher asked the students to write a short story about a journey they would like to take.',
    'Music fills the hall as the orchestra plays, the violins rising and the drums keeping the time.',
    'Doctors and nurses work through the night to care for patients in the busy city hospital.',
    'Children play football in the park after school until their parents call them home for supper.',
    'What is the capital of France? Paris is the capital of France, and Rome is the capital of Italy.',
    'How many days are there in a week? There are seven days in a week and twelve months in a year.',
    'Please summarise the following article in three sentences, keeping only the most important facts.',
    'Thank you for your help! You are welcome; let me know if there is anything else I can do for you.',
    'Write a poem about the moon, the stars and the silver light that falls on the sleeping town.',
    'The weather today is sunny with a light breeze, and tomorrow it will probably rain in the afternoon.',
    'Trains leave the central station every hour for the coast, the mountains and the northern cities.',
    'Farmers grow wheat, barley, corn and potatoes, and they keep cows, sheep, goats and chickens.',
    'The market sells fresh fish, ripe fruit, warm bread, spices, flowers and handmade baskets.',
    'Language models predict words one after another, using attention to look back at the context.',
    'An old map showed an island with a hidden cave, a waterfall and a tree shaped like a hand.',
    'The committee will meet on Thursday to discuss the budget, the schedule and the new proposal.',
    'Water boils at one hundred degrees and freezes at zero degrees on the Celsius scale.',
    'The museum displays paintings, sculptures, ancient coins, pottery and the bones of a dinosaur.',
    'After the storm the sky cleared, the sun came out and a rainbow stretched across the hills.',
    'Reading every day improves vocabulary, concentration, imagination and understanding of the world.',
    'The company builds bicycles, electric scooters and small boats in a factory near the river.',
    'Her grandmother taught her to bake bread, knit scarves, grow vegetables and tell stories.',
    'A good question often matters more than a quick answer, because it shows what we do not know.',
    'The astronaut floated inside the station, looking down at the blue curve of the earth below.',
    'Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, hundred.',
    'Colours: red, orange, yellow, green, blue, indigo, violet, black, white, grey, brown and pink.',
    'Animals: cat, dog, horse, rabbit, mouse, lion, tiger, elephant, whale, dolphin, eagle and owl.',
)
