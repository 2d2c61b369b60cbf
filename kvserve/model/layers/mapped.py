"""Dense weights used where the checkpoint file is mapped (``--load-format mmap`` on a safetensors checkpoint).

safetensors' reader maps the file copy-on-write and hands out each tensor as a view of its pages, so a method that
keeps those views, in the file's dtype, holds no copy of the weights: start-up reads nothing ahead, and every
process serving the file shares its pages (the page cache's own) until one writes them, which nothing does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers.linear import AsLoadedLinearMethod, Linear, apply_by_parts, linear_into


class MappedLinearMethod(AsLoadedLinearMethod):
    """Each checkpoint tensor of a layer kept as it arrives (a view of the mapped file). A plain layer's becomes
    its weight; a packed layer (fused qkv, gate_up) keeps its projections apart (``layer.mapped_parts``: joining
    them would copy), each multiplied into its column range of the output; a tied head multiplies the
    embeddings' parameter, mapped by ``VocabEmbedding.keep_loaded``. Torch's GEMM reads them as stored: the
    prepacked, oneDNN and small-GEMM layouts are copies. Biases are joined into the layer's bias (a copy of
    ``out_features`` values), as are the other small tensors the model copies into its parameters (norms)."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        parts = self.loaded_parts(layer)
        layer.mapped_parts = tuple(parts) if len(parts) > 1 else None
        if len(parts) == 1:
            layer.weight = nn.Parameter(parts[0], requires_grad=False)  # the view itself: no copy

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.mapped_parts is None:
            return F.linear(x, layer.weight, layer.bias)
        return apply_by_parts(layer, layer.mapped_parts, x, linear_into)
