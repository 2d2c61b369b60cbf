"""The grammar-mask kernel against its plain-PyTorch twin and xgrammar's own apply, on odd vocabulary sizes
and masks of every kind of word (all ones, all zeros, mixed)."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from kvserve.sample.token_mask import _library, apply_token_mask, reference_apply


def random_mask(rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab_size // 32)), generator=gen, dtype=torch.int64)
    kind = torch.randint(0, 3, words.shape, generator=gen)
    words = torch.where(kind == 0, torch.full_like(words, -1), torch.where(kind == 1, 0, words))
    return words.to(torch.int32)


@pytest.mark.parametrize("vocab_size, width", [(49152, 49152), (1000, 1000), (517, 544), (33, 64)])
def test_the_kernel_equals_its_twin_and_xgrammar(vocab_size: int, width: int) -> None:
    assert _library() is not None
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(1))
    mask = random_mask(6, vocab_size, seed=vocab_size)
    rows = [0, 2, 3, 5]
    kernel, twin, theirs = logits.clone(), logits.clone(), logits.clone()
    apply_token_mask(kernel, mask, rows, vocab_size)
    reference_apply(twin, mask, rows, vocab_size)
    xgrammar.apply_token_bitmask_inplace(theirs, mask, vocab_size=vocab_size, indices=rows)
    assert torch.equal(kernel, twin)
    assert torch.equal(kernel[:, :vocab_size], theirs[:, :vocab_size])  # past it xgrammar may mask a word's rest
    assert torch.equal(kernel[[1, 4]], logits[[1, 4]])  # rows not named are untouched
    assert torch.isinf(kernel[rows, :vocab_size]).any() and torch.isfinite(kernel[rows, :vocab_size]).any()
