"""AdaKV: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient
LLM Inference", 2024, arXiv:2407.11550.

Signal: SnapKV's pooled window attention; the layer's budget goes to the highest scores of any KV
head (each head keeps at least ``floor`` of the uniform budget, and its protected window): the
selection's ``allocation="layer"``. Heads then hold different numbers of entries and the engine stores
them ragged, each at its own length, so the cache holds exactly the budget's bytes. Its scores are
attention mass over the same entries, comparable across the heads of a layer (the paper's premise).
"""

from dataclasses import replace

from kvsieve.policies.snapkv import SnapKV
from kvsieve.selection import Selection


class AdaKV(SnapKV):
    """SnapKV's scores under the layer's allocation: the spec ``snapkv(allocation='layer', adaptive_floor=0.2)``."""

    name = "adakv"

    def __init__(self, floor: float = 0.2, kernel_size: int = 5, **kwargs) -> None:
        self.floor = floor
        super().__init__(kernel_size=kernel_size, **kwargs)

    def default_selection(self) -> Selection:
        return replace(super().default_selection(), allocation="layer", adaptive_floor=self.floor)
