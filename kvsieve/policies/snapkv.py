"""SnapKV: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
arXiv:2404.14469.

Signal: attention from the last ``window`` queries (the observation window), summed over the
window, averaged over the query heads of a KV head, smoothed with 1-D average pooling. The window
itself is always kept.
"""

import torch
import torch.nn.functional as F

from kvsieve.policies.base import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


def snapkv_scores(signals: Signals, kernel_size: int = 5) -> torch.Tensor:
    """(b, h, n) pooled window attention; shared by PyramidKV, AdaKV and ChunkKV."""
    scores = signals.window_attention_kv.sum(dim=2)
    if kernel_size > 1:
        b, h, n = scores.shape
        scores = F.avg_pool1d(scores.view(b * h, 1, n), kernel_size, stride=1, padding=kernel_size // 2,
                              count_include_pad=False).view(b, h, n)
    return scores


class SnapKV(Policy):
    name = "snapkv"

    def __init__(self, kernel_size: int = 5, **kwargs) -> None:
        if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size!r}")
        self.kernel_size = kernel_size
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(recent=self.window)

    def score(self, signals: Signals) -> torch.Tensor:
        return snapkv_scores(signals, self.kernel_size)
