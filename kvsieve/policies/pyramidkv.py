"""PyramidKV: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", 2024, arXiv:2406.02069.

Signal: SnapKV's pooled window attention; budgets fall linearly with depth (lower layers keep
more), same mean budget. Layers end up with different cache lengths, which kvsieve's attention
handles physically (no padding).
"""

from dataclasses import replace

from kvsieve.policies.snapkv import SnapKV
from kvsieve.selection import Selection


class PyramidKV(SnapKV):
    """SnapKV's scores under pyramid layer budgets: the spec ``snapkv(layer_budgets='pyramid', pyramid_beta=20.0)``."""

    name = "pyramidkv"

    def __init__(self, beta: float = 20.0, kernel_size: int = 5, **kwargs) -> None:
        self.beta = beta
        super().__init__(kernel_size=kernel_size, **kwargs)

    def default_selection(self) -> Selection:
        return replace(super().default_selection(), layer_budgets="pyramid", pyramid_beta=self.beta)
