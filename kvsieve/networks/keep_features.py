"""Per-entry features of the learned policy, read from one layer's :class:`~kvsieve.signals.Signals`.

DistillCache's policy network reads "attention statistics, value norms, entropy, and position"
(paper abstract). Here each cached entry of each KV head gets ``len(FEATURES)`` numbers, scaled so
that they mean the same on any model and context length (the network is shared by every layer and
head, and a checkpoint should transfer between lengths):

* ``attn_mean``, ``attn_max``: attention the entry receives from the observation window's queries
  (every query head of the KV head's group, every window query), mean and max, times ``n`` (uniform
  attention is 1 at any length), then ``log1p``.
* ``attn_last``: attention from the last window query alone (mean over the group's query heads), same
  scale: what TOVA keeps by (Oren et al. 2024), which the window mean and max cannot single out.
* ``attn_trend``: late-half mean minus early-half mean of the window (same scale): an entry that the
  latest queries turn to is rising (0 for a window of one query).
* ``attn_entropy``: entropy of the distributions of the window queries that attend the entry,
  weighted by how much each attends it, divided by ``log n`` (1 = uniform). A per-entry quantity,
  not a per-layer scalar: the queries looking at an entry may be sharp while the layer is diffuse.
* ``value_norm``, ``key_norm``: ``log`` of the L2 norm over its mean in the layer's head, so the
  layer's scale (which varies over models and depth) cancels.
* ``rel_position``: position / last position (0 first token seen, 1 last).
* ``recency``: ``log1p(distance to the next query) / log1p(tokens seen)``: log-scaled, so it
  separates the recent entries that ``rel_position`` squeezes together near 1.
* ``depth``: layer index / (layers - 1).
* ``layer``: the layer index itself, as a float; the network turns it into a learned embedding.
"""

from __future__ import annotations

import math

import torch

from kvsieve.signals import Signals

__all__ = ["FEATURES", "NUM_FLOAT_FEATURES", "extract"]

FEATURES: tuple[str, ...] = (
    "attn_mean",
    "attn_max",
    "attn_last",
    "attn_trend",
    "attn_entropy",
    "value_norm",
    "key_norm",
    "rel_position",
    "recency",
    "depth",
    "layer",  # last column: integer layer index for the embedding
)
NUM_FLOAT_FEATURES = len(FEATURES) - 1

_EPS = 1e-12


def _log_relative(norms: torch.Tensor) -> torch.Tensor:
    return torch.log(norms.clamp_min(_EPS) / norms.mean(dim=-1, keepdim=True).clamp_min(_EPS))


@torch.no_grad()
def extract(signals: Signals) -> torch.Tensor:
    """(b, h, n, len(FEATURES)) float32 features of every cached entry of one layer."""
    attention = signals.window_attention  # (b, h*g, w, n), float32, causal inside the window
    b, hq, w, n = attention.shape
    h, g = signals.num_kv_heads, signals.num_groups
    grouped = attention.view(b, h, g, w, n)
    scaled = float(n)
    mean = grouped.mean(dim=(2, 3))
    top = grouped.amax(dim=(2, 3))
    if w >= 2:
        half = w // 2
        trend = torch.log1p(scaled * grouped[:, :, :, half:].mean(dim=(2, 3))) - torch.log1p(
            scaled * grouped[:, :, :, :half].mean(dim=(2, 3)))
    else:
        trend = torch.zeros_like(mean)
    row_entropy = -(attention * torch.log(attention.clamp_min(_EPS))).sum(dim=-1)  # (b, hq, w)
    weight = attention.sum(dim=2)  # (b, hq, n)
    weighted = torch.einsum("bqwn,bqw->bqn", attention, row_entropy)
    fallback = row_entropy.mean(dim=-1, keepdim=True).expand_as(weighted)
    entropy = torch.where(weight > 0, weighted / weight.clamp_min(_EPS), fallback)
    entropy = entropy.view(b, h, g, n).mean(dim=2) / max(math.log(n), 1.0)
    seen = float(signals.future_position)
    distance = (seen - 1.0 - signals.positions.float()).clamp_min(0.0)
    columns = [
        torch.log1p(scaled * mean),
        torch.log1p(scaled * top),
        torch.log1p(scaled * grouped[:, :, :, -1].mean(dim=2)),
        trend,
        entropy,
        _log_relative(signals.value_norms),
        _log_relative(signals.key_norms),
        signals.relative_positions,
        torch.log1p(distance) / math.log1p(max(seen, 1.0)),
        torch.full_like(mean, signals.layer_idx / max(1, signals.num_layers - 1)),
        torch.full_like(mean, float(signals.layer_idx)),
    ]
    return torch.stack([c.float() for c in columns], dim=-1)
