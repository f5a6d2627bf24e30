"""The one interface every eviction policy implements: hand-made, evolved or learned.

At the bottom of the house: it imports only selection and signals, so the engine, the registry, the
learned and the evolved policies all build on it without importing each other.

A policy maps the :class:`~kvsieve.signals.Signals` of one layer to scores shaped
(batch, kv_heads, seq); higher means keep. Which entries are then kept (top-k per head, chunks,
protected tokens, per-layer or per-head budgets) is decided by its :class:`~kvsieve.selection.Selection`,
so a policy is only a scorer plus a default selection.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from kvsieve.selection import Selection, check_allocation
from kvsieve.signals import Signals

__all__ = ["Policy", "FullCache", "check_allocation"]


class Policy:
    """Base class. Subclasses set ``name`` and implement :meth:`score`.

    Class attributes:
        name: registry name.
        needs_accumulated_attention: ask the engine to accumulate ``Signals.attention_received``
            (costs about one extra attention pass during prefill).
        needs_query_stats: ask the engine to collect the pre-RoPE query statistics
            (``Signals.query_stats``: mean and covariance of every query, about one extra projection-sized
            matmul per layer and forward).
        needs_hidden_states: ask the engine to keep the hidden states entering each layer's attention during
            the prefill (``Signals.hidden_states``: one hidden-size row per token and layer until the compression).
        intrinsic_scores: an entry's score depends on that entry alone (its key, value and position), never on
            what else is cached or on the queries: in decode mode the engine keeps each score with its entry
            (``Signals.entry_scores``, NaN for the entries appended since the last eviction), so the policy need
            score only those, which every KV head still holds (kvzap on a cache pruned per head).
        needs_reconstruction: scores come from a forward that makes the model repeat the context
            (KVzip, :mod:`kvsieve.engine.reconstruct`); prefill mode only.
        evicts: ``False`` only for the full-cache policy (and serve's gathering stand-in); a point reads it as
            ``Point.compresses``.
        uses_window: reads the observation window (its queries or the protected recent tokens);
            ``False`` lets a context shorter than ``window`` be compressed.
        is_reference: a reference line for reports (the answer-span oracle), never offered for real use.
        needs_spans: built per sample from the answer's spans (``important_positions``); such samples only.
        comparable_across_heads / comparable_across_layers: whether a score of one KV head (layer)
            means as much as the same score of another, so a budget may move to the higher one
            (``Selection(allocation="layer")`` needs the first, ``"global"`` both, unless the selection
            normalises, ``normalization="zscore"``). The defaults fit attention-based scores: the
            heads of a layer attend over the same entries; layers are not assumed comparable.
    """

    name: ClassVar[str] = "base"
    needs_accumulated_attention: ClassVar[bool] = False
    needs_query_stats: ClassVar[bool] = False
    needs_hidden_states: bool = False  # an instance may set it (kvzap: when its checkpoint reads them)
    needs_reconstruction: ClassVar[bool] = False
    intrinsic_scores: ClassVar[bool] = False
    evicts: ClassVar[bool] = True
    uses_window: ClassVar[bool] = True
    is_reference: ClassVar[bool] = False
    needs_spans: ClassVar[bool] = False
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

    @classmethod
    def content_paths(cls, **params) -> tuple[Path, ...]:
        """The files whose bytes define this policy's results (an evolved program, a trained checkpoint, the
        surrogate a program reads); empty for a policy computed from the signals alone.

        Results of such a policy are keyed by those files' sha256 (:class:`kvsieve.policies.registry.PolicySpec`).
        """
        return ()

    @classmethod
    def named_params(cls, **params) -> dict:
        """``params`` with each file given by a path that a shipped or named file's bytes are (a named program, a
        checkpoint) given by that name instead: the results store keys rows by the spec's text, so rows of a moved or
        copied file meet the name's. Unchanged for a policy no file defines."""
        return params

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
    evicts = False

    def score(self, signals: Signals) -> torch.Tensor:
        return torch.zeros(signals.batch_size, signals.num_kv_heads, signals.seq_len, device=signals.keys.device)
