"""AdaKV: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient
LLM Inference", 2024, arXiv:2407.11550.

Signal: SnapKV's pooled window attention; the layer's budget goes to the highest scores of any KV
head (each head keeps at least ``floor`` of the uniform budget, and its protected window): the
selection's ``allocation="layer"``. Heads then hold different numbers of entries and the engine stores
them ragged, each at its own length, so the cache holds exactly the budget's bytes. Its scores are
attention mass over the same entries, comparable across the heads of a layer (the paper's premise).
"""

import torch

from kvsieve.policies.snapkv import snapkv_scores
from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


class AdaKV(Policy):
    name = "adakv"

    def __init__(self, floor: float = 0.2, kernel_size: int = 5, **kwargs) -> None:
        self.floor = floor
        self.kernel_size = kernel_size
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(recent=self.window, allocation="layer", adaptive_floor=self.floor)

    def score(self, signals: Signals) -> torch.Tensor:
        return snapkv_scores(signals, self.kernel_size)
