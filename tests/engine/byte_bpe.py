"""A tiny byte-level BPE tokenizer trained offline, whose merges split multi-byte characters across tokens."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, SEP = "<s>", "</s>", "<|sep|>"
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "naïve café déjà vu — crème brûlée",
    "你好世界，你好吗？世界很大。",
    "emoji: 🙂🚀🎉 and 👍🏽 in text 🙂🙂",
    "stop STOP end. The End! ### done",
]


@functools.cache
def byte_bpe_tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[BOS, EOS, SEP],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS,
                                   additional_special_tokens=[SEP])


@functools.cache
def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece's way, as Gemma's: words as pieces with ``▁`` for a space, and any character the vocabulary
    lacks as its UTF-8 bytes, one ``<0xE2>`` token each (decoded by runs: an invalid run as a U+FFFD a byte)."""
    pieces = ["<unk>", BOS, EOS, *(f"<0x{byte:02X}>" for byte in range(256)), "▁", "▁x", "▁hello", "a", "b", "c"]
    bpe = Tokenizer(models.BPE({piece: i for i, piece in enumerate(pieces)}, [], unk_token="<unk>",
                               byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, unk_token="<unk>")
