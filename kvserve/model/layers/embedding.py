"""Token embeddings whose rows may be split over tensor-parallel ranks (vocab-parallel), or kept as the checkpoint
holds them: in a GGUF's blocks, or as the view of a mapped safetensors file."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers.ggml import KERNEL_TYPES, GGMLGemm, GGMLTensor, ggml_gemm
from kvserve.model.layers.linear import WeightShapeError, copy_weight
from kvserve.model.layers.tensor_parallel import LinearShard, Shardable, TensorParallel


class VocabEmbedding(Shardable, nn.Embedding):
    """``nn.Embedding``; once ``shard``-ed, this rank holds ``ceil(vocab / size)`` rows, looks up the ids that
    fall in them (zeros for the others) and all-reduces: one collective per step."""

    tp_shard: LinearShard | None = None
    blocks_kernel: GGMLGemm | None = None  # set by ``keep_blocks``
    ggml_weight: GGMLTensor | None = None
    keeps_loaded: bool = False  # set by ``keep_loaded``

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        # rows left uninitialised, as the checkpoint fills them: nn.Embedding's random init, even on the meta
        # device, imports torch._dynamo (0.6 s of a server's start)
        super().__init__(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))

    def shard(self, tp: TensorParallel) -> None:
        first, count = tp.split_vocab(self.num_embeddings)
        self.tp_shard = LinearShard(tp, 0, {None: (first, count)})
        self.weight = nn.Parameter(torch.empty(count, self.embedding_dim, dtype=self.weight.dtype),
                                   requires_grad=False)

    def keep_blocks(self, kernel: GGMLGemm) -> None:
        """Keep the embeddings in the blocks they arrive in (of a type ``kernel`` reads), which ``forward``
        dequantizes a looked-up row at a time, instead of their fp32 rows."""
        self.blocks_kernel = kernel

    def keep_loaded(self) -> None:
        """Make the checkpoint's tensor itself the weight (under ``--load-format mmap``, a view of the mapped file,
        in the model's dtype; one rank), instead of a copy of it."""
        self.keeps_loaded = True

    def load_weight(self, tensor: torch.Tensor | GGMLTensor) -> None:
        """Copy the checkpoint's [vocab, hidden] embeddings (this rank's rows of them) into ``weight``, or keep
        their blocks (``keep_blocks``) or the tensor itself (``keep_loaded``)."""
        if self.keeps_loaded:
            if tensor.shape != self.weight.shape:
                raise WeightShapeError(tensor.shape, self.weight.shape)
            self.weight.data = tensor  # a tied head's too: it shares the parameter
            return
        if self.blocks_kernel is not None and isinstance(tensor, GGMLTensor) and tensor.qtype in KERNEL_TYPES:
            if tuple(tensor.shape) != tuple(self.weight.shape):
                raise WeightShapeError(torch.Size(tensor.shape), self.weight.shape)
            self.ggml_weight = tensor
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # a tied head's too: it shares the parameter
            return
        if self.tp_shard is not None:
            tensor = self.tp_shard.narrow(tensor, None)
        fp32_rows = self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        kernel = ggml_gemm() if fp32_rows and isinstance(tensor, GGMLTensor) and tensor.qtype in KERNEL_TYPES else None
        if kernel is not None and tuple(tensor.shape) == tuple(self.weight.shape):
            # the block kernel's dequantization, in C: gguf's numpy one took 0.2 s of the default model's start
            kernel.dequantize(tensor, self.weight.data)
            return
        copy_weight(self.weight, tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ggml_weight is not None:
            rows = self.ggml_weight.blocks.index_select(0, input_ids.reshape(-1))
            hidden = self.blocks_kernel.dequantize(GGMLTensor(rows, self.ggml_weight.qtype,
                                                              (rows.shape[0], self.embedding_dim)))
            return hidden.view(*input_ids.shape, self.embedding_dim)
        if self.tp_shard is None:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.tp_shard.ranges[None][0]
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return self.tp_shard.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))
