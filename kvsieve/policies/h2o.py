"""H2O: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, arXiv:2306.14048.

Signal: the attention each entry has received, accumulated over every query the layer has processed
("heavy hitters"); the budget is split evenly between the heavy hitters and the most recent tokens
(the paper's setting, e.g. 10% heavy + 10% recent for a 20% cache): ``Selection(recent_share=0.5)``
protects the last ``round(kept / 2)`` entries and gives the rest to the top accumulated scores. The
engine accumulates the attention during prefill and decoding (about one extra attention pass).

Normalisation: the score is the plain sum, over every query the layer processed and over the query
heads that share the KV head, of their softmax attention to the entry. This is the paper's
accumulated attention score (its greedy eviction adds each step's attention to a running sum; the
authors' code sums the prompt's attention over query positions per head; for GQA, summing over the
group is Meta's llama-recipes H2O port and only rescales a per-head sum). A token at position ``i``
of an ``n``-token prompt is seen by ``n - i`` queries, so the sum favours early tokens. We keep it
anyway: that bias is part of the method being compared against (the paper keeps the plain sum), and
the recent half of the budget is what protects the late tokens. Dividing by the number of queries
that saw each token would be a different policy.
"""

import torch

from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


class H2O(Policy):
    name = "h2o"
    needs_accumulated_attention = True
    uses_window = False  # the recent tokens are a share of the budget, not the observation window

    def __init__(self, recent_share: float = 0.5, **kwargs) -> None:
        self.recent_share = recent_share
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(recent_share=self.recent_share)

    def score(self, signals: Signals) -> torch.Tensor:
        if signals.attention_received is None:
            raise RuntimeError("h2o needs accumulated attention; run it through kvsieve.attach()")
        return signals.attention_received
