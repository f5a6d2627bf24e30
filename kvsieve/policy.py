"""The one interface every eviction policy implements: hand-made, evolved or learned.

At the bottom of the house: it imports only selection and signals, so the engine, the registry, the
learned and the evolved policies all build on it without importing each other.

A policy maps the :class:`~kvsieve.signals.Signals` of one layer to scores shaped
(batch, kv_heads, seq); higher means keep. Which entries are then kept (top-k per head, chunks,
protected tokens, per-layer or per-head budgets) is decided by its :class:`~kvsieve.selection.Selection`,
so a policy is only a scorer plus a default selection.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvsieve.selection import Selection
from kvsieve.signals import Signals

__all__ = ["Policy", "FullCache", "check_allocation"]


def check_allocation(policy: Policy, selection: Selection) -> None:
    """Refuse a selection that compares scores the policy does not declare comparable."""
    if selection.normalization != "none" or selection.allocation == "uniform":
        return
    across = []
    if not policy.comparable_across_heads:
        across.append("heads")
    if selection.allocation == "global" and not policy.comparable_across_layers:
        across.append("layers")
    if across:
        what = " and ".join(across)
        raise ValueError(
            f"policy {policy.name!r} does not declare its scores comparable across {what}, so "
            f"allocation={selection.allocation!r} cannot move budget between them: use "
            "Selection(normalization='zscore') (each head's scores standardised first), or a narrower allocation"
            + (" ('layer' or 'uniform')" if selection.allocation == "global" else " ('uniform')"))


class Policy:
    """Base class. Subclasses set ``name`` and implement :meth:`score`.

    Class attributes:
        name: registry name.
        needs_accumulated_attention: ask the engine to accumulate ``Signals.attention_received``
            (costs about one extra attention pass during prefill).
        needs_query_stats: ask the engine to collect the pre-RoPE query statistics
            (``Signals.query_stats``: mean and covariance of every query, about one extra projection-sized
            matmul per layer and forward).
        needs_reconstruction: scores come from a forward that makes the model repeat the context
            (KVzip, :mod:`kvsieve.engine.reconstruct`); prefill mode only.
        compresses: ``False`` only for the full-cache policy.
        uses_window: reads the observation window (its queries or the protected recent tokens);
            ``False`` lets a context shorter than ``window`` be compressed.
        comparable_across_heads / comparable_across_layers: whether a score of one KV head (layer)
            means as much as the same score of another, so a budget may move to the higher one
            (``Selection(allocation="layer")`` needs the first, ``"global"`` both, unless the selection
            normalises, ``normalization="zscore"``). The defaults fit attention-based scores: the
            heads of a layer attend over the same entries; layers are not assumed comparable.
    """

    name: ClassVar[str] = "base"
    needs_accumulated_attention: ClassVar[bool] = False
    needs_query_stats: ClassVar[bool] = False
    needs_reconstruction: ClassVar[bool] = False
    compresses: ClassVar[bool] = True
    uses_window: ClassVar[bool] = True
    comparable_across_heads: ClassVar[bool] = True
    comparable_across_layers: ClassVar[bool] = False

    def __init__(self, selection: Selection | None = None, window: int = 64) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self.window = window
        self.selection = selection if selection is not None else self.default_selection()
        check_allocation(self, self.selection)

    def default_selection(self) -> Selection:
        return Selection()

    def check_model(self, model, name: str | None = None) -> None:
        """Refuse a model this policy was not made for (``name``: the name it was loaded under, if known).

        Policies computed from the signals alone fit any model; a learned policy is tied to the model it
        was trained on and refuses others of the same geometry.
        """

    def score(self, signals: Signals) -> torch.Tensor:
        """Return (batch, kv_heads, seq) scores; higher is kept first."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window}, selection={self.selection})"


class FullCache(Policy):
    """Keeps everything: no compression. The reference every other policy is measured against."""

    name = "full"
    uses_window = False
    compresses = False

    def score(self, signals: Signals) -> torch.Tensor:
        return torch.zeros(signals.batch_size, signals.num_kv_heads, signals.seq_len, device=signals.keys.device)
