"""Expected Attention: Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention
from Future Queries Distribution", 2025, arXiv:2510.00636. The authors' reference implementation is
NVIDIA kvpress's ``ExpectedAttentionPress`` (the paper introduces kvpress); where the paper leaves a
detail open, kvsieve follows it.

Signal: the attention a cached key should receive from the queries *still to come*. The method models
a future query as Gaussian, with the mean ``mu`` and covariance ``Sigma`` of the layer's queries
**before** the rotary embedding, estimated per query head from every query the layer has processed
except the first ``sink`` positions (attention-sink outliers). A query at future position ``j`` is
``R_j q`` (``R_j`` the RoPE rotation, including the model's attention scaling); the method replaces
``R_j`` by its average over the next ``n_future`` positions, ``R = mean_{t<T} R_{P+t}`` (``P`` = tokens
seen, ``T = 512``), so ``mu' = R mu`` and ``Sigma' = R Sigma R^T``. With the softmax scale ``s``, the
Gaussian moment generating function gives, for each key ``k``,

    E[exp(s q.k)] = exp(s mu'.k + s^2 k^T Sigma' k / 2),

normalised over the cache **without** the sinks (they are protected, not scored), averaged over the
query heads that share the KV head, then ``(a + epsilon) * ||v||`` (the value norm weighs what the
entry would add to the residual stream).

Choices, each as the authors' reference sets it:
  * ``n_future = 512`` (kvpress ``n_future_positions``), ``sink = 4`` (``n_sink``), population
    covariance (divided by the count).
  * ``epsilon = 0.01``: the authors' benchmark configuration (kvpress ``evaluation/evaluate_registry.py``:
    ``ExpectedAttentionPress(epsilon=1e-2)``; the class default there is 0).
  * Queries of models with a query norm (Qwen3, Gemma3) are taken after ``q_norm``, the distribution
    the rotary embedding is applied to.

Remaining simplifications, documented:
  * The averaged rotation is applied to the moments as a single matrix ("slightly abusive", as the
    authors' notebook says: the covariance of the rotated mixture also has a spread-of-means term);
    this is what the reference does.
  * The scale is the model's own softmax scale ``s`` (``d ** -0.5`` for Llama/Qwen/Mistral, where it
    equals the reference's ``1/sqrt(d)`` and ``1/(2d)``; Gemma3's ``query_pre_attn_scalar`` otherwise).
  * Heads keep equal budgets. The paper's headline runs wrap the scorer in AdaKV's head-adaptive
    budgets (kvpress registry: ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``); pass
    ``selection=Selection(sink=4, head_budgets="adaptive")`` for that variant.
  * Statistics cover every query the layer processed (prompt, question, generated tokens), not only
    the last forward pass as in the reference, which sees one prefill.
"""

from __future__ import annotations

import math

import torch

from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals

__all__ = ["ExpectedAttention", "averaged_rotation"]

_KEY_BLOCK = 4096  # keys per block for the quadratic term, bounds a (b, h, g, block, d) buffer


def averaged_rotation(
    inv_freq: torch.Tensor, attention_scaling: float, start: int, count: int, head_dim: int
) -> torch.Tensor:
    """(d, d) mean of the RoPE matrices of positions ``start .. start+count-1``, in float32.

    Layout as transformers' ``rotate_half``: frequency ``i`` rotates dims ``i`` and ``i + r/2`` of the
    first ``r = 2 len(inv_freq)`` dims (the rest pass through); cos/sin carry ``attention_scaling``.
    """
    half = inv_freq.shape[0]
    positions = torch.arange(start, start + count, dtype=torch.float64, device=inv_freq.device)
    angles = positions[:, None] * inv_freq.double()[None, :]  # (T, r/2)
    cos = angles.cos().mean(dim=0) * attention_scaling
    sin = angles.sin().mean(dim=0) * attention_scaling
    rotation = torch.eye(head_dim, dtype=torch.float64, device=inv_freq.device)
    i = torch.arange(half, device=inv_freq.device)
    rotation[i, i] = cos
    rotation[i + half, i + half] = cos
    rotation[i, i + half] = -sin
    rotation[i + half, i] = sin
    return rotation.float()


class ExpectedAttention(Policy):
    name = "expected_attention"
    needs_query_stats = True
    uses_window = False  # scores come from the query statistics, not the observation window

    def __init__(self, sink: int = 4, epsilon: float = 0.01, n_future: int = 512, **kwargs) -> None:
        if isinstance(n_future, bool) or not isinstance(n_future, int) or n_future < 1:
            raise ValueError(f"n_future must be a positive int, got {n_future!r}")
        self.sink = sink
        self.epsilon = epsilon
        self.n_future = n_future
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(sink=self.sink)

    def score(self, signals: Signals) -> torch.Tensor:
        if signals.query_stats is None or signals.rope_inv_freq is None:
            raise RuntimeError("expected_attention needs pre-RoPE query statistics; run it through kvsieve.attach()")
        b, h, n, d = signals.keys.shape
        g = signals.num_groups
        sinks = min(self.sink, n)
        scores = torch.full((b, h, n), math.inf, device=signals.keys.device)
        if sinks == n:
            return scores
        mean, cov = signals.query_moments(self.sink)  # (b, hq, d), (b, hq, d, d)
        rotation = averaged_rotation(signals.rope_inv_freq.to(mean.device), signals.rope_attention_scaling,
                                     signals.future_position, self.n_future, d)
        mean = (mean @ rotation.T).view(b, h, g, d)
        cov = (rotation @ cov @ rotation.T).view(b, h, g, d, d)
        s = signals.scaling
        keys = signals.keys.float()[:, :, None, sinks:]  # (b, h, 1, n - sinks, d): sinks are not scored
        logits = []
        for start in range(0, keys.shape[3], _KEY_BLOCK):
            block = keys[:, :, :, start : start + _KEY_BLOCK]
            linear = (block @ mean[..., None]).squeeze(-1)  # (b, h, g, block)
            quadratic = ((block @ cov) * block).sum(-1)
            logits.append(s * linear + 0.5 * s * s * quadratic)
        attention = torch.softmax(torch.cat(logits, dim=-1), dim=-1).mean(dim=2)  # (b, h, n - sinks)
        scores[..., sinks:] = (attention + self.epsilon) * signals.value_norms[..., sinks:]
        return scores
