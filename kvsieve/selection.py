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
        recent_share: fraction of each layer's budget given to the most recent entries (H2O splits its
            budget evenly: 0.5); the protected tail is the largest of ``recent``, this share and the
            caller's protected tail.
        chunk_size: >1 keeps whole chunks only (ChunkKV). Candidates are the full chunks of
            ``chunk_size`` unprotected entries on a grid starting at the first entry after the sinks;
            the ``(budget - protected) // chunk_size`` candidates with the highest mean score are kept
            and the rest of the budget stays unused (every head keeps the same number of entries).
        layer_budgets: ``"uniform"`` or ``"pyramid"`` (PyramidKV, see :meth:`layer_budgets_for`).
        pyramid_beta: PyramidKV's beta (top layer / mean of the non-protected budget).
        head_budgets: ``"uniform"`` or ``"adaptive"`` (AdaKV: the layer's total budget goes to the
            highest scores of any head, each head keeping at least ``adaptive_floor`` of ``k``).
        adaptive_floor: AdaKV's safeguard fraction.
    """

    sink: int = 0
    recent: int = 0
    recent_share: float = 0.0
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
        if not 0.0 <= self.recent_share < 1.0:
            raise ValueError(f"Selection.recent_share must be in [0, 1), got {self.recent_share!r}")
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

    def layer_budgets_for(
        self, kept: int, seq_len: int | None, num_layers: int, protected: int | None = None
    ) -> list[int]:
        """Per-layer budgets whose mean is ``kept`` (exactly, when ``kept * num_layers`` allows).

        Uniform: ``kept`` everywhere (at most ``seq_len``). Pyramid (PyramidKV, arXiv:2406.02069, Sec. 3):
        every layer keeps its protected entries (sinks + window, ``w``; ``protected`` overrides it) plus a
        share of the rest, ``c = kept - w``, falling linearly with depth from ``2c - c/beta`` (bottom) to
        ``c/beta`` (top).
        A bottom budget above the context is clamped to it and the top raised by as much, so the
        mean stays ``kept``; where the top would then fall below the window (``c/beta < 0``), or
        ``kept`` leaves nothing beyond the window, the budgets are uniform. ``seq_len=None`` means an
        unbounded context (decode-time eviction). Rounding keeps the sum at ``kept * num_layers``.
        """
        cap = seq_len
        uniform = [kept if cap is None else min(kept, cap)] * num_layers
        window = self.sink + self.recent if protected is None else protected
        shared = kept - window
        if self.layer_budgets == "uniform" or num_layers == 1 or shared <= 0:
            return uniform
        top = shared / self.pyramid_beta
        bottom = 2 * shared - top
        if cap is not None and window + bottom > cap:  # clamp the bottom, give the rest to the top
            bottom = cap - window
            top = 2 * shared - bottom
        if top < 0:
            return uniform
        exact = [window + bottom + (top - bottom) * i / (num_layers - 1) for i in range(num_layers)]
        budgets = [math.floor(x) for x in exact]
        missing = kept * num_layers - sum(budgets)
        # largest remainders first (ties: lower layer first); never above the context
        order = sorted(range(num_layers), key=lambda i: (-(exact[i] - budgets[i]), i))
        for i in order[: max(missing, 0)]:
            budgets[i] += 1
        return [b if cap is None else min(b, cap) for b in budgets]

    def layer_kept(self, kept: int, seq_len: int | None, layer_idx: int, num_layers: int) -> int:
        """Budget of one layer given the mean per-layer budget ``kept`` (see :meth:`layer_budgets_for`)."""
        return self.layer_budgets_for(kept, seq_len, num_layers)[layer_idx]

    def protected_mask(self, n: int, kept: int, protected_tail: int = 0, device=None) -> torch.Tensor:
        """(n,) bool: the sinks and the protected tail (``recent``, ``recent_share`` of ``kept``, the caller's)."""
        protected = torch.zeros(n, dtype=torch.bool, device=device)
        protected[: min(self.sink, n)] = True
        tail = min(n, max(self.recent, round(kept * self.recent_share), protected_tail))
        if tail:
            protected[n - tail :] = True
        return protected

    def kept_indices(
        self, scores: torch.Tensor, kept: int, protected_tail: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(indices, valid)``: (b, h, k) ascending indices of kept entries per head.

        ``valid`` is ``None`` unless head budgets are adaptive; then it is a (b, h, k) bool mask
        and ``k`` is the largest head budget (invalid entries are padding, masked in attention).
        Whole chunks (``chunk_size > 1``) may leave part of the budget unused: ``k <= kept``.
        """
        b, h, n = scores.shape
        protected = self.protected_mask(n, kept, protected_tail, scores.device)
        n_protected = int(protected.sum())
        if n_protected > kept:
            raise ValueError(
                f"budget of {kept} entries is below the {n_protected} protected ones (sink={self.sink}, "
                f"recent={self.recent}, recent_share={self.recent_share}, protected tail={protected_tail});"
                " raise the budget"
            )
        scores = torch.nan_to_num(scores.double(), nan=float("-inf"))
        if self.chunk_size > 1:
            return self._whole_chunks(scores, protected, kept), None
        token_rank = _descending_rank(scores)  # 0 = best
        # Priority: protected first, then token rank.
        order_key = (~protected).long().expand(b, h, n) * (n + 1) + token_rank
        if self.head_budgets == "uniform":
            indices = torch.topk(-order_key, kept, dim=-1).indices
            return indices.sort(dim=-1).values, None
        return self._adaptive(scores, order_key, protected, kept)

    def _whole_chunks(self, scores: torch.Tensor, protected: torch.Tensor, kept: int) -> torch.Tensor:
        b, h, n = scores.shape
        free = (~protected).nonzero().flatten()
        start, stop = (int(free[0]), int(free[-1]) + 1) if len(free) else (0, 0)
        n_chunks = (stop - start) // self.chunk_size
        taken = min(n_chunks, (kept - int(protected.sum())) // self.chunk_size)
        keep = protected.expand(b, h, n).clone()
        if taken > 0:
            grid = scores[..., start : start + n_chunks * self.chunk_size].reshape(b, h, n_chunks, self.chunk_size)
            means = grid.clamp(min=-1e300).mean(dim=-1)  # -inf scores count as very low
            best = _descending_rank(means) < taken  # (b, h, n_chunks)
            keep[..., start : start + n_chunks * self.chunk_size] = best.repeat_interleave(self.chunk_size, dim=-1)
        width = int(protected.sum()) + taken * self.chunk_size
        return keep.long().argsort(dim=-1, descending=True, stable=True)[..., :width].sort(dim=-1).values

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
