"""Running statistics of a layer's pre-RoPE queries: what a policy may see of the queries to come.

Expected Attention (Devoto et al., arXiv:2510.00636) models the queries not yet seen as Gaussian with
the mean and covariance of those the layer computed so far, before the rotary embedding. The engine
fills these statistics (``kvsieve/engine/query_hooks.py`` hooks the query projections); a policy reads
them through :attr:`kvsieve.signals.Signals.query_stats`. This module holds only the data, so the
signals a policy sees do not depend on the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EARLY_POSITIONS", "QueryStats"]

# Queries of the first positions are kept one by one, so a policy can leave out any number of attention
# sinks up to this many (the rest are summed); 64 x head_dim floats per head is a few KiB.
EARLY_POSITIONS = 64


@dataclass(frozen=True)
class QueryStats:
    """Running statistics of one layer's pre-RoPE queries, per batch row and query head (float32).

    Immutable: :meth:`add` returns a new object, so a shallow copy of a cache (the grid runner's
    ``clone_cache``) never sees the queries another copy reads later.

    Attributes:
        early: (b, hq, e, d) queries of positions ``0 .. e-1``, ``e <= EARLY_POSITIONS``.
        count: number of queries at positions ``>= EARLY_POSITIONS``.
        mean: (b, hq, d) their mean.
        m2: (b, hq, d, d) their sum of centred outer products (Chan et al.'s pairwise update, which
            avoids the cancellation of ``sum q q^T - n mean mean^T`` in float32).
    """

    early: torch.Tensor
    count: int
    mean: torch.Tensor
    m2: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, device=None) -> QueryStats:
        return cls(
            early=torch.zeros(batch, heads, 0, head_dim, device=device),
            count=0,
            mean=torch.zeros(batch, heads, head_dim, device=device),
            m2=torch.zeros(batch, heads, head_dim, head_dim, device=device),
        )

    @classmethod
    def from_queries(cls, queries: torch.Tensor, start: int = 0) -> QueryStats:
        """Statistics of ``queries`` (b, hq, q, d) taken at positions ``start .. start+q-1``."""
        b, hq, _, d = queries.shape
        return cls.empty(b, hq, d, queries.device).add(queries, start)

    @property
    def batch_size(self) -> int:
        return self.mean.shape[0]

    @property
    def total(self) -> int:
        """Queries seen so far (all positions)."""
        return self.early.shape[2] + self.count

    def add(self, queries: torch.Tensor, start: int) -> QueryStats:
        """These statistics plus ``queries`` (b, hq, q, d) at positions ``start .. start+q-1``."""
        queries = queries.detach().float()
        if start != self.total:
            raise ValueError(f"queries start at position {start} but {self.total} were seen before")
        n_early = max(0, min(queries.shape[2], EARLY_POSITIONS - start))
        early = torch.cat([self.early, queries[:, :, :n_early]], dim=2) if n_early else self.early
        rest = queries[:, :, n_early:]
        count, mean, m2 = _merge(self.count, self.mean, self.m2, rest)
        return QueryStats(early, count, mean, m2)

    def moments(self, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, hq, d) mean and (b, hq, d, d) covariance of the queries at positions ``>= skip``.

        The covariance is the population one (divided by the count), as the authors' reference
        (NVIDIA kvpress ``ExpectedAttentionPress``) computes it.
        """
        if skip > EARLY_POSITIONS:
            raise ValueError(f"query statistics leave out at most the first {EARLY_POSITIONS} positions, got {skip}")
        count, mean, m2 = _merge(self.count, self.mean, self.m2, self.early[:, :, skip:])
        if count == 0:
            raise ValueError(f"no query statistics beyond the first {skip} positions: the context is too short")
        return mean, m2 / count

    def __getitem__(self, rows) -> QueryStats:
        """Only the batch ``rows`` (a decode batch dropping its finished rows)."""
        return QueryStats(self.early[rows], self.count, self.mean[rows], self.m2[rows])


def _merge(count: int, mean: torch.Tensor, m2: torch.Tensor, queries: torch.Tensor):
    """Add ``queries`` (b, hq, q, d) to (count, mean, m2): Chan, Golub and LeVeque's pairwise update."""
    n = queries.shape[2]
    if n == 0:
        return count, mean, m2
    batch_mean = queries.mean(dim=2)
    centred = queries - batch_mean[:, :, None]
    batch_m2 = centred.transpose(-1, -2) @ centred
    total = count + n
    delta = batch_mean - mean
    mean = mean + delta * (n / total)
    m2 = m2 + batch_m2 + delta[..., :, None] * delta[..., None, :] * (count * n / total)
    return total, mean, m2
