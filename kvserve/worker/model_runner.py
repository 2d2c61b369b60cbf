"""ModelRunner: executes one SchedulerOutput on the device and returns only token ids (and logprobs)."""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.selector import select_backend
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from kvserve.model.loader import Checkpoint
from kvserve.model.registry import load_model
from kvserve.sample.sampler import Sampler, SamplingBatch, prompt_logprobs
from kvserve.sched.output import ModelOutput, SchedulerOutput, TokenLogprobs
from kvserve.worker.input_batch import InputBatch, build_input_batch


class ModelRunner:
    """Owns the model weights, the paged KV tensors, the attention backend and the sampler state."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, block_size: int) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.backend: AttentionBackend = select_backend(device, dtype)
        self.model = load_model(checkpoint, self.backend, dtype, device)
        self.sampler = Sampler()
        self.kv: KVCacheStorage | None = None
        self._sliding_windows = self.model.sliding_windows()

    def kv_cache_spec(self) -> KVCacheSpec:
        m = self.model
        return KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, self.block_size, self.dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv = KVCacheStorage(self.kv_cache_spec(), num_blocks, self.device)

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelOutput:
        assert self.kv is not None, "init_kv_cache() must run before execute()"
        self.sampler.drop(sched_out.finished_request_ids)
        self.kv.copy_blocks(sched_out.kv_transfers.copies)
        if sched_out.is_empty:
            return ModelOutput(sampled_token_ids={})
        batch = build_input_batch(sched_out, self.block_size, self.device)
        meta = self.backend.build_metadata(batch.attn, self._sliding_windows)
        hidden = self.model(batch.input_ids, batch.positions, meta, self.kv)
        output = self._sample(batch, hidden)
        output.prompt_logprobs.update(self._prompt_logprobs(batch, hidden))
        return output

    def _sample(self, batch: InputBatch, hidden: torch.Tensor) -> ModelOutput:
        sampled: dict[str, list[int]] = {r.request_id: [] for r in batch.sample_requests}
        forks: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        fork_logprobs: dict[str, list[TokenLogprobs]] = {}
        if not batch.sample_requests:
            return ModelOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        result = self.sampler(logits, SamplingBatch.from_rows(batch.sample_requests, batch.sample_indices))
        token_ids = result.token_ids  # the step's one device-to-host copy
        for row, (req, index) in enumerate(zip(batch.sample_requests, batch.sample_indices)):
            is_fork = req.num_samples > 1 and index > 0
            (forks.setdefault(req.request_id, []) if is_fork else sampled[req.request_id]).append(token_ids[row])
            if result.logprobs is not None and result.logprobs[row] is not None:
                target = fork_logprobs if is_fork else logprobs
                target.setdefault(req.request_id, []).append(result.logprobs[row])
        return ModelOutput(sampled, forks, logprobs, fork_logprobs)

    def _prompt_logprobs(self, batch: InputBatch, hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        out: dict[str, list[TokenLogprobs]] = {}
        for req, rows, targets in zip(
            batch.prompt_logprob_requests, batch.prompt_logprob_rows, batch.prompt_logprob_targets
        ):
            logits = self.model.compute_logits(hidden[rows])
            out[req.request_id] = prompt_logprobs(logits, targets, req.sampling_params.prompt_logprobs)
        return out
