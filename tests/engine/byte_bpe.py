"""A tiny byte-level BPE tokenizer trained offline, whose merges split multi-byte characters across tokens."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
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
