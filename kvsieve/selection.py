"""Scores -> kept indices: per-head top-k, chunks, protected sink/recent tokens, layer and head budgets.

The engine asks a :class:`Selection` which cache entries to keep. ``allocation`` says where a budget
may move: ``"uniform"`` (every KV head of a layer keeps the same number), ``"layer"`` (AdaKV: a layer's
total goes to the best scores of any of its heads) or ``"global"`` (KVzip: the model's total goes to
the best scores of any layer and head). Every head keeps at least its floor (its protected sinks and
recent entries, ``adaptive_floor`` of the per-head budget, and one entry) and the total is exactly the
budget. Heads left at different lengths are stored ragged by the engine, so no byte is padding.

Moving budget between heads or layers compares their scores. A policy declares whether its scores
are comparable (``Policy.comparable_across_heads`` / ``comparable_across_layers``); when they are
not, ``normalization="zscore"`` standardises each head's free scores (mean 0, standard deviation 1
over its finite, unprotected entries) before they are compared, else the policy refuses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Budget", "Selection", "ALLOCATIONS", "NORMALIZATIONS", "check_allocation"]

ALLOCATIONS = ("uniform", "layer", "global")
NORMALIZATIONS = ("none", "zscore")


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
        head_budgets: ``"uniform"`` or ``"adaptive"``: the older spelling of ``allocation="uniform"`` /
            ``"layer"`` (either sets the other).
        adaptive_floor: AdaKV's safeguard fraction: under ``"layer"`` and ``"global"`` every head keeps at
            least this fraction of its layer's per-head budget.
        allocation: ``"uniform"``, ``"layer"`` or ``"global"`` (see the module docstring).
        normalization: ``"none"`` or ``"zscore"``, applied to the scores before heads (and layers) are
            compared under ``"layer"``/``"global"``.
    """

    sink: int = 0
    recent: int = 0
    recent_share: float = 0.0
    chunk_size: int = 1
    layer_budgets: Literal["uniform", "pyramid"] = "uniform"
    pyramid_beta: float = 20.0
    head_budgets: Literal["uniform", "adaptive"] = "uniform"
    adaptive_floor: float = 0.2
    allocation: Literal["uniform", "layer", "global"] = "uniform"
    normalization: Literal["none", "zscore"] = "none"

    def __post_init__(self) -> None:
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation {self.allocation!r} is not one of {', '.join(map(repr, ALLOCATIONS))}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization {self.normalization!r} is not one of "
                             f"{', '.join(map(repr, NORMALIZATIONS))}")
        if self.head_budgets == "adaptive" and self.allocation == "uniform":
            object.__setattr__(self, "allocation", "layer")
        elif self.allocation != "uniform" and self.head_budgets == "uniform":
            object.__setattr__(self, "head_budgets", "adaptive")
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
            raise ValueError(f"allocation {self.allocation!r} (budgets moving between heads) and chunk_size > 1 "
                             "cannot be combined")
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
        scores = _as_scores(scores)
        if self.chunk_size > 1:
            return self._whole_chunks(scores, protected, kept), None
        if self.head_budgets == "uniform":  # protected first, then the best scores
            kept = min(kept, n)
            keep = protected.expand(b, h, n) | _top_mask(scores, kept - n_protected, exclude=protected)
            return _ascending_indices(keep, kept), None
        return self.allocate([scores], [kept], protected_tail=None, _protected=[protected])[0]

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
            best = _top_mask(means, taken)  # (b, h, n_chunks)
            keep[..., start : start + n_chunks * self.chunk_size] = best.repeat_interleave(self.chunk_size, dim=-1)
        width = int(protected.sum()) + taken * self.chunk_size
        return _ascending_indices(keep, width)  # protected entries and whole chunks: ``width`` in every head

    def allocate(self, scores: list[torch.Tensor], budgets: list[int], protected_tail: int | None = 0,
                 _protected: list[torch.Tensor] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Share ``sum(budgets) * kv_heads`` entries among the heads of several layers, per batch row.

        ``scores``: one (b, h, n_l) tensor per layer (lengths may differ; ``-inf`` marks entries that
        must not be kept, e.g. padding); ``budgets[l]``: the per-head budget of layer ``l`` (the
        protected tail included, as in :meth:`kept_indices`). Every head first gets its floor (its
        protected entries, then its best ones up to ``max(adaptive_floor * budget, 1)``); the rest of the
        total goes to the highest (normalised) scores of any head in ``scores``, ties to the earlier
        layer, head and entry. Returns per layer ``(indices, valid)`` as :meth:`kept_indices` does
        under adaptive budgets: (b, h, w) ascending indices, ``w`` the layer's widest head, and the
        mask of the entries really kept (``None`` when every head keeps ``w``).
        """
        if len(scores) != len(budgets):
            raise ValueError(f"{len(scores)} layers of scores but {len(budgets)} budgets")
        b, h = scores[0].shape[:2]
        chosen, pools = [], []
        for layer, (s, kept) in enumerate(zip(scores, budgets)):
            n = s.shape[-1]
            if _protected is not None:
                protected = _protected[layer]
            else:
                protected = self.protected_mask(n, kept, protected_tail or 0, s.device)
                if int(protected.sum()) > kept:
                    raise ValueError(f"budget of {kept} entries is below the {int(protected.sum())} protected ones "
                                     f"(sink={self.sink}, recent={self.recent}, protected tail={protected_tail});"
                                     " raise the budget")
            s = _as_scores(s)
            keepable = s > float("-inf")
            n_protected = int(protected.sum())
            floor = min(kept, n, max(int(self.adaptive_floor * kept), n_protected, 1))
            # the floor: every protected entry, then the head's best scores
            pick = protected.expand(b, h, n) | _top_mask(s, floor - n_protected, exclude=protected)
            pick &= keepable | protected  # a floor never keeps padding (unless the caller protects it)
            chosen.append(pick)
            free = s.masked_fill(pick | ~keepable, float("-inf"))
            if self.normalization == "zscore":
                free = _zscore(free, protected)
            pools.append(free.reshape(b, h * n))
        total = h * sum(budgets)
        pool = torch.cat(pools, dim=-1)
        sizes = [p.shape[-1] for p in pools]
        for row in range(b):  # rows hold different numbers of keepable entries: one pick per row
            remaining = total - int(sum(c[row].sum() for c in chosen))
            available = int((pool[row] > float("-inf")).sum())
            take = max(0, min(remaining, available))
            if take:
                flat = _top_mask(pool[row], take)
                for c, part in zip(chosen, flat.split(sizes)):
                    c[row] |= part.view(h, -1)
        picked = []
        for c in chosen:
            count = c.sum(dim=-1, keepdim=True)
            width = int(count.max())
            # a head keeping fewer than the widest pads with its first entries not kept (masked by ``valid``)
            padding = ~c & ((~c).cumsum(dim=-1) <= width - count)
            indices = _ascending_indices(c | padding, width)
            valid = c.gather(-1, indices)
            picked.append((indices, None if bool(valid.all()) else valid))
        return picked


def _zscore(free: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """Standardise each head's finite free scores (mean 0, std 1); -inf and +inf stay as they are."""
    finite = torch.isfinite(free) & ~protected
    count = finite.sum(-1, keepdim=True).clamp_min(1)
    zeros = torch.zeros_like(free)
    mean = torch.where(finite, free, zeros).sum(-1, keepdim=True) / count
    var = torch.where(finite, (free - mean) ** 2, zeros).sum(-1, keepdim=True) / count
    scaled = (free - mean) / var.sqrt().clamp_min(1e-12)
    return torch.where(torch.isfinite(free), scaled, free)


def check_allocation(policy, selection: Selection) -> None:
    """Refuse a selection that compares scores ``policy`` does not declare comparable.

    Reads the policy's ``comparable_across_heads`` (default True: a layer's heads attend over the same
    entries) and ``comparable_across_layers`` (default False).
    """
    if selection.normalization != "none" or selection.allocation == "uniform":
        return
    across = []
    if not getattr(policy, "comparable_across_heads", True):
        across.append("heads")
    if selection.allocation == "global" and not getattr(policy, "comparable_across_layers", False):
        across.append("layers")
    if across:
        raise ValueError(
            f"policy {getattr(policy, 'name', policy)!r} does not declare its scores comparable across "
            f"{' and '.join(across)}, so allocation={selection.allocation!r} cannot move budget between them: use "
            "Selection(normalization='zscore') (each head's scores standardised first), or a narrower allocation"
            + (" ('layer' or 'uniform')" if selection.allocation == "global" else " ('uniform')"))


def _as_scores(scores: torch.Tensor) -> torch.Tensor:
    """float64 scores, NaN as -inf (never kept by choice). ``nan_to_num`` alone would also turn -inf (padding)
    and +inf into the largest finite numbers: padding would become keepable and a z-score would overflow."""
    inf = float("inf")
    return torch.nan_to_num(scores.double(), nan=-inf, posinf=inf, neginf=-inf)


def _top_mask(values: torch.Tensor, k: int, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask of the ``k`` largest ``values`` along the last dim, ties to the earlier entry (as a stable
    descending sort would pick them), never an ``exclude``d entry; fewer when fewer are not excluded.

    A selection (``kthvalue``), not a sort: the global pick over every layer's heads is ~15x faster.
    """
    if exclude is not None:
        values = values.masked_fill(exclude, float("-inf"))
    n = values.shape[-1]
    if k <= 0 or n == 0:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    k = min(k, n)
    threshold = values.kthvalue(n - k + 1, dim=-1, keepdim=True).values  # the k-th largest
    above = values > threshold  # never an excluded entry: those are -inf
    tied = values == threshold
    if exclude is not None:
        tied &= ~exclude
    return above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))


def _ascending_indices(mask: torch.Tensor, width: int) -> torch.Tensor:
    """(..., width) ascending positions of ``mask``'s True entries; every row must hold exactly ``width``."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    return positions[mask].view(*mask.shape[:-1], width)
