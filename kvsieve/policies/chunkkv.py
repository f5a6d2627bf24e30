"""ChunkKV: Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context
LLM Inference", 2025, arXiv:2502.00299.

Signal: SnapKV's window attention averaged over all KV heads, kept in contiguous chunks ranked by
their mean score; every head keeps the same chunks. Spans survive whole, so a multi-token number
is not cut in half.
"""

import torch

from kvsieve.policies.base import Policy
from kvsieve.policies.snapkv import snapkv_scores
from kvsieve.selection import Selection
from kvsieve.signals import Signals


class ChunkKV(Policy):
    name = "chunkkv"

    def __init__(self, chunk_size: int = 10, **kwargs) -> None:
        self.chunk_size = chunk_size
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(recent=self.window, chunk_size=self.chunk_size)

    def score(self, signals: Signals) -> torch.Tensor:
        scores = snapkv_scores(signals, kernel_size=1)
        return scores.mean(dim=1, keepdim=True).expand_as(scores)
