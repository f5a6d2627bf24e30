"""FRC (feature-rich compression): the three-signal scorer discovered by CacheCraft, "Discovering KV
Cache Eviction Policies via LLM-Guided Program Evolution" (its abstract).

The paper's abstract names the three signals and the selection, not the formulas; kvsieve's design
of each, with fixed weights for every model (no per-model tuning):

* **local attention received** ``L``: the attention each entry receives from the observation window's
  queries (each query's causal softmax, summed over the window), averaged over the query heads of a
  KV head: SnapKV's signal before pooling.
* **neighbourhood attention density** ``D``: ``L`` averaged over a centred neighbourhood of
  ``density_kernel`` = 9 entries (zero padded). An entry inside a span that the window reads (a
  number, a key, a name) inherits its neighbours' attention, so a span is kept together even where
  one of its tokens is rarely attended to.
* **KV-head max salience** ``M``: the *max* over the query heads that share a KV head of the window
  attention they give the entry. The mean (SnapKV) dilutes an entry that one query head of the
  group reads strongly; a KV entry serves every head of its group, so one reader is enough.

Each signal is divided by its mean over the layer's context entries (per head), so the three are
on the same scale whatever the model's attention temperature, and the score is
``0.4 L + 0.4 D + 0.2 M``. Selection is chunk-level top-k (``chunk_size`` = 4): whole chunks of 4
entries ranked by their mean score, the observation window always kept; small chunks keep a span's
neighbours without spending a large chunk's budget on haystack.
"""

import torch

from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals

WEIGHTS = (0.4, 0.4, 0.2)  # local, density, head max


def frc_scores(signals: Signals, density_kernel: int = 9, weights: tuple[float, float, float] = WEIGHTS
               ) -> torch.Tensor:
    """(b, h, n) FRC scores from the window attention of one layer."""
    b, h, n = signals.batch_size, signals.num_kv_heads, signals.seq_len
    received = signals.window_attention.sum(dim=2).reshape(b, h, signals.num_groups, n)  # (b, h, g, n)
    local = received.mean(dim=2)
    density = torch.nn.functional.avg_pool1d(local.reshape(b * h, 1, n), density_kernel, stride=1,
                                             padding=density_kernel // 2, count_include_pad=True).view(b, h, n)
    head_max = received.amax(dim=2)

    def unit_mean(x: torch.Tensor) -> torch.Tensor:
        return x / x.mean(dim=-1, keepdim=True).clamp_min(1e-12)

    w_local, w_density, w_max = weights
    return w_local * unit_mean(local) + w_density * unit_mean(density) + w_max * unit_mean(head_max)


class FRC(Policy):
    name = "frc"

    def __init__(self, chunk_size: int = 4, density_kernel: int = 9, **kwargs) -> None:
        if not isinstance(density_kernel, int) or density_kernel < 1 or density_kernel % 2 == 0:
            raise ValueError(f"density_kernel must be a positive odd int, got {density_kernel!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.density_kernel = density_kernel
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(recent=self.window, chunk_size=self.chunk_size)

    def score(self, signals: Signals) -> torch.Tensor:
        return frc_scores(signals, self.density_kernel)
