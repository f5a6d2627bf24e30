"""ChunkKV: Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context
LLM Inference", 2025, arXiv:2502.00299.

Signal: SnapKV's observation-window attention (window 64, 1-D average pooling with kernel 5, as in the
authors' implementation, contributed to NVIDIA kvpress as ``ChunkKVPress(press=SnapKVPress())``),
averaged over every KV head of the layer, so all heads keep the same chunks. Selection: the context
before the window is cut into contiguous chunks of ``chunk_size = 10`` tokens (the paper's
recommended size, robust across tasks and models in its ablation), chunks are ranked by their mean
score (the paper sums the chunk's scores; for whole chunks the ranking is the same), and the
``(budget - window) // 10`` best chunks are kept **whole**, together with the window. Spans survive
whole, so a multi-token number is not cut in half.

Simplifications: a trailing partial chunk (when the prefix is not a multiple of 10) is never kept
(the paper's ``ceil(n / c)`` chunks include it), and the part of the budget below one chunk stays
unused; the paper's layer-wise index reuse (a speed optimisation) is not implemented.
"""

import torch

from kvsieve.policies.snapkv import SnapKV
from kvsieve.signals import Signals


class ChunkKV(SnapKV):
    """SnapKV's scores averaged over the layer's heads, kept in whole chunks (SnapKV's own ``chunk_size``)."""

    name = "chunkkv"

    def __init__(self, chunk_size: int = 10, kernel_size: int = 5, **kwargs) -> None:
        super().__init__(kernel_size=kernel_size, chunk_size=chunk_size, **kwargs)

    def score(self, signals: Signals) -> torch.Tensor:
        scores = super().score(signals)
        return scores.mean(dim=1, keepdim=True).expand_as(scores)
