"""The engine on CUDA: the same greedy tokens as transformers on the CPU (fp32), for every family.

Run on a GPU machine with ``python -m pytest -m gpu``; skipped where no CUDA device is present.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.model.checkpoint import ARCHITECTURES
from tests.conftest import hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_on_cuda_matches_transformers_on_cpu(tiny_checkpoints, arch: str) -> None:
    path = tiny_checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (5, 40, 17, 1, 33)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(path), dtype="float32", device="cuda", num_kv_blocks=64, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["num_blocks_used"] == 0


def test_bf16_on_cuda_runs_and_frees_every_block(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="bfloat16", device="cuda", num_kv_blocks=64)
    outs = llm.generate(["hello"] * 4, SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True, seed=1))
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert llm.stats()["num_blocks_used"] == 0 and llm.stats()["kv_cache_dtype"] == "bfloat16"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                   n=2),
    # continued steps draw after the step before is read back (ModelRunner.draw_deferred)
    SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
], ids=["penalties", "grammar"])
def test_continued_requests_on_cuda_match_the_cpu_engine(tiny_checkpoints, params: SamplingParams) -> None:
    """The penalties' counts on the device and a grammar's deferred draws, with the overlapped scheduler
    continuing their rows (on by default on CUDA): the tokens of the same engine on the CPU, where no step runs
    ahead."""
    path = str(tiny_checkpoints["llama"])
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]} for n in (5, 40, 17, 1, 33)]
    options = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    on_cpu = LLM(path, device="cpu", **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, device="cuda", **options)
    on_cuda = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in on_cuda] == [[c.token_ids for c in o.outputs] for o in on_cpu]
    assert llm.stats()["num_steps_scheduled_ahead"] > 0
    assert llm.stats()["num_blocks_used"] == 0
