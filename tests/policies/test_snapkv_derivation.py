"""SnapKV's score against a from-scratch numpy derivation (arXiv:2404.14469, Algorithm 1, with the authors' GQA
answer in SnapKV issue #22): per query head, the softmax of the window queries over the causal row; summed over
the window; averaged over the query heads of each KV head; the prefix (not the window) average-pooled with
kernel 5, stride 1 and zero padding that counts. Written with loops over heads and positions, no torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.policies.snapkv import SnapKV, snapkv_scores
from kvsieve.signals import Signals


def numpy_snapkv(q: np.ndarray, k: np.ndarray, scale: float, kernel: int) -> np.ndarray:
    """q: (hq, w, d) window queries; k: (h, n, d) keys -> (h, n) scores."""
    hq, w, _ = q.shape
    h, n, _ = k.shape
    g = hq // h
    per_query_head = np.zeros((hq, n))
    for j in range(hq):
        kv = j // g  # HF's repeat_kv: query heads j*g .. j*g+g-1 read KV head j
        for i in range(w):
            visible = n - w + i + 1  # window query i sees the prefix and window entries up to itself
            logits = np.array([q[j, i] @ k[kv, t] * scale for t in range(visible)])
            p = np.exp(logits - logits.max())
            per_query_head[j, :visible] += p / p.sum()
    scores = np.stack([per_query_head[kv * g:(kv + 1) * g].mean(axis=0) for kv in range(h)])
    prefix, r = n - w, kernel // 2
    pooled = scores.copy()
    for kv in range(h):
        for t in range(prefix):
            window = [scores[kv, s] if 0 <= s < prefix else 0.0 for s in range(t - r, t + r + 1)]
            pooled[kv, t] = sum(window) / kernel  # the zero padding counts in the mean
    return pooled


@pytest.mark.parametrize("hq,h,kernel", [(4, 2, 5), (9, 3, 5), (6, 6, 3), (8, 2, 7)])
def test_snapkv_score_equals_the_numpy_derivation(hq, h, kernel):
    rng = np.random.default_rng(hq * 10 + h)
    n, w, d = 23, 6, 8
    q = rng.normal(size=(hq, w, d)) * 2.0  # sharp attention: an error in the mask or grouping shows
    k = rng.normal(size=(h, n, d))
    scale = d ** -0.5
    signals = Signals(keys=torch.tensor(k[None], dtype=torch.float32),
                      values=torch.zeros(1, h, n, d), window_queries=torch.tensor(q[None], dtype=torch.float32),
                      positions=torch.arange(n).expand(1, h, n), layer_idx=0, num_layers=1, scaling=scale)
    got = snapkv_scores(signals, kernel).numpy()[0]
    np.testing.assert_allclose(got, numpy_snapkv(q, k, scale, kernel), rtol=1e-5, atol=1e-6)


def test_a_needle_that_every_window_query_reads_is_kept_whole_at_half_the_budget():
    # a 7-token needle at 40..46 that every window query of every head attends to: its pooled scores lead the
    # prefix, and per-head top-k at 50% keeps all seven tokens in every KV head (the selection is not what
    # truncates a needle)
    h, g, n, w, d = 3, 3, 128, 16, 16
    rng = np.random.default_rng(0)
    k = rng.normal(size=(h, n, d)) * 0.1
    direction = rng.normal(size=d)
    k[:, 40:47] += direction * 3
    q = np.tile(direction, (h * g, w, 1)) + rng.normal(size=(h * g, w, d)) * 0.1
    signals = Signals(keys=torch.tensor(k[None], dtype=torch.float32), values=torch.zeros(1, h, n, d),
                      window_queries=torch.tensor(q[None], dtype=torch.float32),
                      positions=torch.arange(n).expand(1, h, n), layer_idx=0, num_layers=1, scaling=d ** -0.5)
    policy = SnapKV(window=w)
    scores = policy.score(signals)
    indices, valid = policy.default_selection().kept_indices(scores, n // 2)
    assert valid is None
    for head in range(h):
        assert set(range(40, 47)) <= set(indices[0, head].tolist())
