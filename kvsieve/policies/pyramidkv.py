"""PyramidKV: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", 2024, arXiv:2406.02069.

Signal: SnapKV's pooled window attention; budgets fall linearly with depth (lower layers keep
more), same mean budget. Layers end up with different cache lengths, which kvsieve's attention
handles physically (no padding).
"""

import torch

from kvsieve.policies.snapkv import snapkv_scores
from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


class PyramidKV(Policy):
    name = "pyramidkv"

    def __init__(self, beta: float = 20.0, kernel_size: int = 5, **kwargs) -> None:
        self.beta = beta
        self.kernel_size = kernel_size
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(recent=self.window, layer_budgets="pyramid", pyramid_beta=self.beta)

    def score(self, signals: Signals) -> torch.Tensor:
        return snapkv_scores(signals, self.kernel_size)
