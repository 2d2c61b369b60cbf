"""Every family against transformers, fp32 on CPU: full prompts, chunked prefill with decodes over paged KV,
and greedy decoding token for token. Prompts are longer than the sliding windows of mistral and gemma3."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MinistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.model.checkpoint import ARCHITECTURES, randomize
from kvserve.model.registry import build_model, select_fused_ops
from tests.conftest import hf_greedy
from tests.model.conftest import Family, PagedRunner, hf_logits, random_prompt

ATOL, RTOL = 1e-4, 1e-5


@pytest.fixture(params=ARCHITECTURES)
def family(request: pytest.FixtureRequest, families: dict[str, Family]) -> Family:
    return families[request.param]


def test_tiny_windows_are_shorter_than_the_prompts(families: dict[str, Family]) -> None:
    assert families["mistral"].ours.sliding_windows() == {12}
    assert families["gemma3"].ours.sliding_windows() == {12, None}
    assert families["llama"].ours.sliding_windows() == {None}


def test_prompt_batch_logits_match_hf(family: Family) -> None:
    prompts = [random_prompt(family.vocab_size, 40, seed=1), random_prompt(family.vocab_size, 27, seed=2)]
    logits = family.runner(num_seqs=2).step(dict(enumerate(prompts)))
    for seq, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[seq], hf_logits(family.hf, prompt), atol=ATOL, rtol=RTOL)


def test_chunked_prefill_and_decodes_match_hf(family: Family) -> None:
    """Two sequences: prefill chunks (one crossing a block boundary) share steps with the other's decodes."""
    a = random_prompt(family.vocab_size, 44, seed=3)
    b = random_prompt(family.vocab_size, 33, seed=4)
    schedule = [
        {0: a[:13]},
        {0: a[13:30], 1: b[:9]},
        {0: a[30:31], 1: b[9:29]},
        *({0: a[i : i + 1], 1: b[i - 2 : i - 1]} for i in range(31, 35)),
        *({0: a[i : i + 1]} for i in range(35, 44)),
    ]
    runner = family.runner(num_seqs=2)
    rows: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for step in schedule:
        for seq, logits in runner.step(step).items():
            rows[seq].append(logits)
    ours_a, ours_b = torch.cat(rows[0]), torch.cat(rows[1])
    torch.testing.assert_close(ours_a, hf_logits(family.hf, a), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours_b, hf_logits(family.hf, b[: ours_b.shape[0]]), atol=ATOL, rtol=RTOL)


def test_greedy_decoding_matches_hf_generate(family: Family) -> None:
    """Two prompts decoded in lockstep in one batch, each equal to transformers' generate() on its own."""
    prompts = [random_prompt(family.vocab_size, 10, seed=5), random_prompt(family.vocab_size, 7, seed=6)]
    num_new = 16
    eos = family.hf.generation_config.eos_token_id
    runner = family.runner(num_seqs=2)
    generated: dict[int, list[int]] = {0: [], 1: []}
    step = dict(enumerate(prompts))
    for _ in range(num_new):
        logits = runner.step(step)
        for seq, rows in logits.items():
            generated[seq].append(int(rows[-1].argmax()))
        step = {seq: out[-1:] for seq, out in generated.items() if out[-1] != eos}
        if not step:
            break
    for seq, prompt in enumerate(prompts):
        assert generated[seq] == hf_greedy(family.hf, prompt, num_new)


TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)
VARIANTS = {
    "llama-linear-rope-tied-biases": lambda: LlamaConfig(
        **TINY, rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
    ),
    "llama-yarn-rope": lambda: LlamaConfig(
        **TINY, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    # a Mistral checkpoint with layer_types, which transformers reads as Ministral's: only its sliding layers window
    "ministral-layer-types": lambda: MinistralConfig(
        **TINY, head_dim=16, sliding_window=7, layer_types=["full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),
    "qwen2-sliding-layers": lambda: Qwen2Config(**TINY, use_sliding_window=True, sliding_window=9, max_window_layers=1),
    "qwen3-attention-bias": lambda: Qwen3Config(**TINY, head_dim=24, attention_bias=True),
    "gemma3-logit-softcap": lambda: Gemma3TextConfig(
        **TINY, head_dim=16, query_pre_attn_scalar=20, sliding_window=7, final_logit_softcapping=3.0,
        layer_types=["full_attention", "sliding_attention"],
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variants_match_hf(variant: str) -> None:
    """Options the tiny checkpoints do not use, each through chunked prefill and decodes."""
    config = VARIANTS[variant]()
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    randomize(hf, seed=0)
    backend = TorchRefBackend()
    fused_ops = select_fused_ops(torch.device("cpu"), torch.float32)  # the engine's, as the tiny families use
    ours = build_model(config, backend, torch.float32, "cpu", fused_ops=fused_ops)
    ours.load_weights(hf.state_dict().items())
    prompt = random_prompt(config.vocab_size, 36, seed=9)
    runner = PagedRunner(ours, backend, num_seqs=1, max_len=64)
    chunks = [prompt[:11], prompt[11:30], *([t] for t in prompt[30:])]
    logits = torch.cat([runner.step({0: chunk})[0] for chunk in chunks])
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)
