"""Expected Attention: Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention
from Future Queries Distribution", 2025, arXiv:2510.00636.

Signal: the attention a key should receive from *future* queries, modelled as Gaussian with the
mean and covariance of the observation-window queries: E[exp(q.k s)] = exp(mu.k s + s^2 k'Sigma k / 2),
normalised over the cache, averaged over grouped heads, weighted by the value norm.
Simplification: statistics are taken on the rotated window queries as they are, without the
paper's averaging of the rotary embedding over future positions.
"""

import torch

from kvsieve.policies.base import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


class ExpectedAttention(Policy):
    name = "expected_attention"

    def __init__(self, sink: int = 4, epsilon: float = 0.02, **kwargs) -> None:
        self.sink = sink
        self.epsilon = epsilon
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(sink=self.sink)

    def score(self, signals: Signals) -> torch.Tensor:
        queries = signals.window_queries.float()  # (b, hq, w, d)
        mean = queries.mean(dim=2)  # (b, hq, d)
        centred = queries - mean[:, :, None]
        cov = centred.transpose(-1, -2) @ centred / max(queries.shape[2] - 1, 1)  # (b, hq, d, d)
        keys = signals.keys.float().repeat_interleave(signals.num_groups, dim=1)  # (b, hq, n, d)
        s = signals.scaling
        logits = s * (keys @ mean[..., None]).squeeze(-1) + 0.5 * s * s * ((keys @ cov) * keys).sum(-1)
        attention = torch.softmax(logits, dim=-1)
        b, hq, n = attention.shape
        attention = attention.view(b, signals.num_kv_heads, signals.num_groups, n).mean(dim=2)
        return (attention + self.epsilon / n) * signals.value_norms
