"""Shared fixtures: seeded tiny checkpoints of every family, and their Hugging Face reference models."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
import torch

# Without CUDA, Triton kernels run only through Triton's interpreter, on CPU tensors (tests/attention/
# test_triton_paged.py). Triton reads TRITON_INTERPRET as it decorates each kernel, its own library functions
# included, at import, and the imports below import it (torch imports triton as transformers loads), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvserve.model import gguf_index
from kvserve.model.checkpoint import ARCHITECTURES, make_checkpoint


@pytest.fixture(scope="session", autouse=True)
def gguf_indexes_in_a_temporary_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """GGUF indexes of the session's files go to a folder of its own, not into the user's model cache."""
    root = tmp_path_factory.mktemp("gguf-index")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_index, "index_root", lambda: root)
        yield root


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny seeded checkpoint per supported family, made once per test session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_checkpoint(root / arch, arch, "tiny", seed=0) for arch in ARCHITECTURES}


def hf_greedy(hf_model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation (fp32, CPU): the reference every engine output is held to."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
        )
    return out[0, len(prompt_ids):].tolist()


def greedy_token_ids(llm, prompts: list[list[int]], max_tokens: int, n: int = 1) -> list[list[list[int]]]:
    """kvserve's greedy samples for token-id prompts: [prompt][sample] -> token ids."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_all_blocks_free(llm) -> None:
    stats = llm.stats()
    assert stats["num_blocks_used"] == 0 and stats["num_blocks_free"] == stats["num_blocks_total"], stats
