"""H2O: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, arXiv:2306.14048.

Signal: attention accumulated over every query the layer has processed ("heavy hitters"), plus a
window of recent tokens. The engine accumulates it during prefill and decoding (about one extra
attention pass).
"""

import torch

from kvsieve.policies.base import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


class H2O(Policy):
    name = "h2o"
    needs_accumulated_attention = True

    def __init__(self, recent: int | None = None, **kwargs) -> None:
        self.recent = recent  # None: as many recent tokens as the observation window
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(recent=self.window if self.recent is None else self.recent)

    def score(self, signals: Signals) -> torch.Tensor:
        if signals.attention_received is None:
            raise RuntimeError("h2o needs accumulated attention; run it through kvsieve.attach()")
        return signals.attention_received
