"""The model identity: what changes it and what must not."""

from __future__ import annotations

import torch

from kvserve.model.identity import model_identity


def _identity(tensors: dict[str, torch.Tensor], config: dict | None = None) -> str:
    return model_identity(tensors.items(), "cpu|float32", config or {"rope_theta": 10000.0})


def test_the_model_identity_tells_a_changed_configuration_or_weight_apart() -> None:
    """Blocks written for one model are never another's: a configuration that shapes the KV (rope here) or a weight
    changed away from its ends gives another identity; where the configuration was loaded from does not."""
    weights = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}
    base = _identity(weights)
    assert _identity(weights, {"rope_theta": 500.0}) != base
    assert _identity(weights, {"rope_theta": 10000.0, "_name_or_path": "/elsewhere",
                               "transformers_version": "9.9"}) == base
    edited = dict(weights, w=weights["w"].clone())
    edited["w"][500] += 1  # not among the first or last 32 values
    assert _identity(edited) != base
    odd = {"w": torch.arange(7, dtype=torch.uint8)[1:]}  # 6 bytes at offset 1: summed byte by byte
    assert _identity(odd) == _identity({"w": odd["w"].clone()})
    swapped = dict(weights, w=weights["w"].clone())
    swapped["w"][[400, 600]] = swapped["w"][[600, 400]]  # the same words, moved: the plain sum alone is blind to it
    assert _identity(swapped) != base


def test_the_model_identity_does_not_depend_on_the_thread_count() -> None:
    weights = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _identity(weights)
        torch.set_num_threads(2)
        assert _identity(weights) == one
    finally:
        torch.set_num_threads(threads)
