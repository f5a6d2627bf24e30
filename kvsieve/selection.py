"""Scores -> kept indices: per-head top-k, chunks, protected sink/recent tokens, layer and head budgets.

The engine asks a :class:`Selection` which cache entries of one layer to keep. Every KV head of a
layer keeps the same number of entries (so the pruned cache stays one dense tensor), except under
``head_budgets="adaptive"`` where heads get different budgets and the shorter heads are padded
with masked entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Budget", "Selection"]


@dataclass(frozen=True)
class Budget:
    """How much of the context to keep: a compression ``ratio`` in [0, 1) or a ``kept`` token count."""

    ratio: float | None = None
    kept: int | None = None

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.kept is None):
            raise ValueError(f"give exactly one of ratio or kept, got ratio={self.ratio!r}, kept={self.kept!r}")
        if self.ratio is not None:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
                raise TypeError(f"ratio must be a number in [0, 1), got {self.ratio!r}")
            if not 0.0 <= float(self.ratio) < 1.0 or math.isnan(self.ratio):
                raise ValueError(f"compression ratio {self.ratio!r} is outside [0, 1)")
        if self.kept is not None:
            if isinstance(self.kept, bool) or not isinstance(self.kept, int):
                raise TypeError(f"kept must be an int, got {self.kept!r}")
            if self.kept <= 0:
                raise ValueError(f"kept token count {self.kept} must be > 0")

    def resolve(self, context_len: int) -> int:
        """Number of entries to keep out of ``context_len``."""
        if context_len <= 0:
            raise ValueError("the context is empty: nothing to compress")
        if self.kept is not None:
            if self.kept > context_len:
                raise ValueError(f"kept={self.kept} is above the context length {context_len}")
            return self.kept
        return max(1, round(context_len * (1.0 - float(self.ratio))))


@dataclass(frozen=True)
class Selection:
    """How scores become kept entries.

    Attributes:
        sink: first entries always kept (attention sinks).
        recent: last entries always kept.
        chunk_size: >1 keeps contiguous chunks ranked by their mean score (ChunkKV); the last chunk
            taken may be partial so every head keeps exactly its budget.
        layer_budgets: ``"uniform"`` or ``"pyramid"`` (PyramidKV: budgets fall linearly with depth,
            bottom ``2k - k/beta``, top ``k/beta``, same mean ``k``).
        pyramid_beta: PyramidKV's beta.
        head_budgets: ``"uniform"`` or ``"adaptive"`` (AdaKV: the layer's total budget goes to the
            highest scores of any head, each head keeping at least ``adaptive_floor`` of ``k``).
        adaptive_floor: AdaKV's safeguard fraction.
    """

    sink: int = 0
    recent: int = 0
    chunk_size: int = 1
    layer_budgets: Literal["uniform", "pyramid"] = "uniform"
    pyramid_beta: float = 20.0
    head_budgets: Literal["uniform", "adaptive"] = "uniform"
    adaptive_floor: float = 0.2

    def __post_init__(self) -> None:
        for name in ("sink", "recent", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "chunk_size" else 0):
                minimum = 1 if name == "chunk_size" else 0
                raise ValueError(f"Selection.{name} must be an int >= {minimum}, got {value!r}")
        if self.layer_budgets not in ("uniform", "pyramid"):
            raise ValueError(f"layer_budgets {self.layer_budgets!r} is not one of 'uniform', 'pyramid'")
        if self.head_budgets not in ("uniform", "adaptive"):
            raise ValueError(f"head_budgets {self.head_budgets!r} is not one of 'uniform', 'adaptive'")
        if self.head_budgets == "adaptive" and self.chunk_size > 1:
            raise ValueError("adaptive head budgets and chunk_size > 1 cannot be combined")
        if self.pyramid_beta < 1:
            raise ValueError(f"pyramid_beta must be >= 1, got {self.pyramid_beta}")
        if not 0.0 <= self.adaptive_floor <= 1.0:
            raise ValueError(f"adaptive_floor must be in [0, 1], got {self.adaptive_floor}")

    def layer_kept(self, kept: int, seq_len: int, layer_idx: int, num_layers: int) -> int:
        """Budget of one layer given the mean per-layer budget ``kept``."""
        if self.layer_budgets == "uniform" or num_layers == 1:
            return min(kept, seq_len)
        top = kept / self.pyramid_beta
        bottom = 2 * kept - top
        budget = bottom + (top - bottom) * layer_idx / (num_layers - 1)
        # never below the protected entries (the window); this can lift the mean slightly above kept
        return int(min(seq_len, max(1, self.sink + self.recent, round(budget))))

    def kept_indices(
        self, scores: torch.Tensor, kept: int, protected_tail: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(indices, valid)``: (b, h, k) ascending indices of kept entries per head.

        ``valid`` is ``None`` unless head budgets are adaptive; then it is a (b, h, k) bool mask
        and ``k`` is the largest head budget (invalid entries are padding, masked in attention).
        """
        b, h, n = scores.shape
        protected = torch.zeros(n, dtype=torch.bool, device=scores.device)
        protected[: min(self.sink, n)] = True
        tail = min(n, max(self.recent, protected_tail))
        if tail:
            protected[n - tail :] = True
        n_protected = int(protected.sum())
        if n_protected > kept:
            raise ValueError(
                f"budget of {kept} entries is below the {n_protected} protected ones "
                f"(sink={self.sink}, recent={self.recent}, protected tail={protected_tail}); raise the budget"
            )
        scores = torch.nan_to_num(scores.double(), nan=float("-inf"))
        token_rank = _descending_rank(scores)  # 0 = best
        if self.chunk_size > 1:
            chunk_rank = _descending_rank(_chunk_means(scores, self.chunk_size))
            major = chunk_rank.repeat_interleave(self.chunk_size, dim=-1)[..., :n]
        else:
            major = token_rank
        # Priority: protected first, then chunk (or token) rank, then token rank inside a chunk.
        unprotected = (~protected).long().expand(b, h, n)
        order_key = unprotected * (n + 1) ** 2 + major * (n + 1) + token_rank
        if self.head_budgets == "uniform":
            indices = torch.topk(-order_key, kept, dim=-1).indices
            return indices.sort(dim=-1).values, None
        return self._adaptive(scores, order_key, protected, kept)

    def _adaptive(self, scores, order_key, protected, kept):
        b, h, n = scores.shape
        floor = min(kept, max(int(self.adaptive_floor * kept), int(protected.sum())))
        guaranteed = order_key.argsort(dim=-1)[..., :floor]
        chosen = torch.zeros(b, h, n, dtype=torch.bool, device=scores.device)
        chosen.scatter_(-1, guaranteed, True)
        remaining = h * kept - h * floor
        if remaining > 0:
            pool = scores.masked_fill(chosen, float("-inf")).reshape(b, h * n)
            extra = torch.topk(pool, remaining, dim=-1).indices
            chosen.view(b, h * n).scatter_(-1, extra, True)
        width = int(chosen.sum(dim=-1).max())
        key = (~chosen).long() * (n + 1) ** 2 + order_key
        indices = torch.topk(-key, width, dim=-1).indices.sort(dim=-1).values
        return indices, chosen.gather(-1, indices)


def _descending_rank(values: torch.Tensor) -> torch.Tensor:
    order = values.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(values.shape[-1], device=values.device).expand_as(order))
    return rank


def _chunk_means(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    b, h, n = scores.shape
    n_chunks = -(-n // chunk)
    padded = torch.full((b, h, n_chunks * chunk), float("nan"), dtype=scores.dtype, device=scores.device)
    padded[..., :n] = scores
    finite = padded.clamp(min=-1e300)  # -inf scores count as very low, not NaN
    return finite.view(b, h, n_chunks, chunk).nanmean(dim=-1)
