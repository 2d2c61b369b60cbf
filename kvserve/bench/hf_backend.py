"""transformers as the baseline of ``kvserve bench throughput``.

Every mode gets the same token ids kvserve gets and generates greedily exactly the requested number of tokens
per request: EOS is generated like any other token and never stops a row, as with kvserve's ``ignore_eos``.

    single          ``generate``, one request at a time
    static          ``generate`` on static left-padded batches of ``batch_size`` in workload order: a batch runs
                    to its longest output, and only each request's own tokens count as output
    generate_batch  transformers' continuous batching: the manager ``model.generate_batch`` drives, fed each
                    request with its own ``max_new_tokens`` (``generate_batch`` takes one for all), with
                    kvserve's token budget and sequence limit per step and a KV cache sized to the requests
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch
import transformers
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvserve.bench.datasets import SampleRequest
from kvserve.model.sources import resolve_model

HF_MODES = ("single", "static", "generate_batch")
RESULT_POLL_S = 1.0

# A runner: requests whose prompts are token ids -> each request's generated token ids, in order.
Generate = Callable[[Sequence[SampleRequest]], list[list[int]]]


def hf_pretrained_args(model: str) -> tuple[str, dict[str, Any]]:
    """``from_pretrained`` arguments for kvserve's model string (a packaged name, a GGUF file or an HF dir)."""
    location = resolve_model(model)
    if location.kind == "gguf":
        return str(location.path.parent), {"gguf_file": location.path.name}
    return str(location.path), {}


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device, dummy: bool = False) -> PreTrainedModel:
    """transformers' model of ``model``; ``dummy``: built from its config with transformers' random init (kvserve's
    ``--load-format dummy``, for speed at real shapes without the weights)."""
    path, kwargs = hf_pretrained_args(model)
    if dummy:
        config = transformers.AutoConfig.from_pretrained(path, **kwargs)
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()


def system_name(mode: str, batch_size: int) -> str:
    return f"hf-static{batch_size}" if mode == "static" else f"hf-{mode}"


def hf_generator(model: PreTrainedModel, mode: str, *, pad_token_id: int, batch_size: int,
                 max_batch_tokens: int, max_num_seqs: int) -> Generate:
    """The runner of one mode; ``batch_size`` is the static batch, the last two limit generate_batch's steps."""
    name = system_name(mode, batch_size)
    if mode == "single":
        return lambda requests: generate_static(model, requests, 1, pad_token_id, name)
    if mode == "static":
        return lambda requests: generate_static(model, requests, batch_size, pad_token_id, name)
    if mode == "generate_batch":
        return ContinuousBatching(model, max_batch_tokens, max_num_seqs, name)
    raise ValueError(f"unknown --hf-mode {mode!r}; choose from {', '.join(HF_MODES)}")


@torch.no_grad()
def generate_padded(model: PreTrainedModel, batch: Sequence[SampleRequest], pad_token_id: int) -> list[list[int]]:
    """One left-padded ``generate`` call; every row runs to the batch's longest output, and each row's
    requested tokens are returned."""
    max_prompt = max(len(r.prompt) for r in batch)
    num_new = max(r.output_len for r in batch)
    input_ids = torch.full((len(batch), max_prompt), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, request in enumerate(batch):
        input_ids[row, max_prompt - len(request.prompt):] = torch.tensor(request.prompt)
        attention_mask[row, max_prompt - len(request.prompt):] = 1
    # eos_token_id=None: EOS neither stops a row nor is masked (min_new_tokens would mask it, unlike kvserve)
    out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                         max_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=pad_token_id)
    if out.shape != (len(batch), max_prompt + num_new):
        raise RuntimeError(f"transformers generate returned {tuple(out.shape)}, expected "
                           f"{(len(batch), max_prompt + num_new)}: it stopped before the requested length")
    return [out[row, max_prompt:max_prompt + r.output_len].tolist() for row, r in enumerate(batch)]


def generate_static(model: PreTrainedModel, requests: Sequence[SampleRequest], batch_size: int,
                    pad_token_id: int, desc: str) -> list[list[int]]:
    outputs: list[list[int]] = []
    with tqdm(total=len(requests), desc=desc, unit="req") as bar:
        for start in range(0, len(requests), batch_size):
            batch = requests[start:start + batch_size]
            outputs += generate_padded(model, batch, pad_token_id)
            bar.update(len(batch))
    return outputs


class ContinuousBatching:
    """The generate_batch runner: each call's requests through one continuous-batching session. The seconds each
    session took to shut down once its last result was in are counted in ``untimed_s``, which the benchmark
    leaves out of the run's time: transformers joins its loop thread then, ~0.5 s whatever the work, and a
    multiturn workload opens a session a turn (kvserve's engine stays up between calls)."""

    def __init__(self, model: PreTrainedModel, max_batch_tokens: int, max_num_seqs: int, desc: str) -> None:
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.desc = desc
        self.untimed_s = 0.0

    @torch.no_grad()
    def __call__(self, requests: Sequence[SampleRequest]) -> list[list[int]]:
        """Without an explicit config, transformers sizes its cache and attention mask for the whole memory (tens
        of seconds of set-up for a tiny model on CPU): the cache is sized to the requests."""
        config = ContinuousBatchingConfig(num_blocks=_num_pages(requests, _tokens_per_page()),
                                          max_batch_tokens=self.max_batch_tokens,
                                          max_requests_per_batch=self.max_num_seqs)
        greedy = GenerationConfig(do_sample=False, eos_token_id=-1)  # -1: no EOS, as generate_batch's docs say
        # warmup captures CUDA graphs; there are none to capture on CPU, and on CUDA they are captured on first use
        with self.model.continuous_batching_context_manager(generation_config=greedy, warmup=False,
                                                            continuous_batching_config=config) as manager:
            request_ids = [manager.add_request(r.prompt, request_id=f"bench-{i}", max_new_tokens=r.output_len,
                                               eos_token_id=-1) for i, r in enumerate(requests)]
            finished = _collect(manager, len(request_ids), self.desc)
            collected = time.perf_counter()
        self.untimed_s += time.perf_counter() - collected
        return [finished[rid] for rid in request_ids]


def _collect(manager: Any, num_requests: int, desc: str) -> dict[str, list[int]]:
    finished: dict[str, list[int]] = {}
    with tqdm(total=num_requests, desc=desc, unit="req") as bar:
        while len(finished) < num_requests:
            result = manager.get_result(timeout=RESULT_POLL_S)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before finishing")
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed {result.request_id}: {result.error}")
            if result.is_finished():
                finished[result.request_id] = list(result.generated_tokens)
                bar.update(1)
    return finished


def _tokens_per_page() -> int:
    """Tokens per cache page of transformers' continuous batching: ``page_size`` since 5.18, ``block_size`` in
    5.17 (transformers' floor here, the version a lent GPU machine's image has)."""
    page_size = getattr(ContinuousBatchingConfig, "page_size", None)
    return page_size if page_size is not None else ContinuousBatchingConfig.block_size


def _num_pages(requests: Sequence[SampleRequest], page_size: int) -> int:
    """Enough cache pages to hold every request at once, with one spare page each."""
    return sum(math.ceil((len(r.prompt) + r.output_len) / page_size) + 1 for r in requests)
