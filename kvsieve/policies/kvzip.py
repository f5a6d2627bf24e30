"""KVzip: Kim, Kim, Kwon, Lee, Yun and Song, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", NeurIPS 2025, arXiv:2505.23416 (code: github.com/snu-mllab/KVzip).

Signal: after the context is prefilled, the model is made to repeat it (teacher-forced): the
instruction "Repeat the previous context exactly." and the context itself are forwarded on top of the
full context cache, chunk by chunk (m = 2048 context tokens per forward, the paper's 2K), and the
reconstruction tokens are dropped afterwards. An entry's score is the largest attention it receives
while the context is being rebuilt:

    S[l, h, i] = max over the query heads g of KV head h, max over reconstruction queries q of
                 softmax_j(q . k_j * scaling)[i]

with j running, in the paper's Algorithm 1 (``normalization="chunk"``, default), over the keys of the
chat-template header, of the chunk being repeated and of the reconstruction tokens up to q (causal),
so chunk t scores the entries of its own context tokens; ``normalization="full"`` takes the softmax
over the whole cache plus the reconstruction tokens (what the forward pass itself computes) and the
max over every chunk's queries. The forward, prompts and chunking are in
:mod:`kvsieve.engine.reconstruct`.

Allocation (``allocation="global"``, default): the paper's non-uniform head budgets. Section 3 gives
scores S in R^{L x H x n_c} and evicts "pairs with the lowest scores"; the authors' code sorts the
scores of every layer and head together and keeps those above one threshold (``KVScore._threshold``
in ``attention/score.py``; kvpress's ``KVzipPress`` does the same unless ``layerwise=True``). So the
budget is global across heads *and* layers: here the ``layers x kv_heads x kept`` best entries of the
whole model, where ``kept`` is the budget per layer, through ``Selection.allocate``. Layers and heads
then hold different lengths and the engine stores them ragged, so the cache holds exactly the budget's
bytes. Every head keeps at least its best entry (a head with no entry cannot attend); with a chat
template the header fills that role and the floor never binds. ``allocation="uniform"`` (the paper's
uniform-head variant, ``_threshold_uniform``) keeps the top ``kept`` entries of every head through
this policy's :class:`~kvsieve.selection.Selection`, like every other policy.

Sinks: the paper keeps no attention sinks besides the system prompt, which its code leaves outside the
eviction range. kvsieve keeps the chat template's header (system prompt and user-turn opener), inside
the budget, and adds no other sinks. Question-aware runs (``protected_tail``, not in the paper) keep the
question on top of the budget and repeat only the context; the instruction then follows the question.

Cost: the reconstruction forwards the n_c context tokens again plus ~20 instruction tokens per chunk,
each attending over the whole cache and its own chunk, so about one more prefill with twice the keys
per query, plus the max-attention statistic (one more attention pass over the chunk's keys for
``"chunk"``, over the whole cache for ``"full"``), block-wise over 512 queries. Each chunk runs on a
shallow copy of the cache that the forward extends, so the peak holds one more copy of the cache. The
grid runner computes the scores once per sample for every kvzip cell and counts their seconds in each
cell's prefill time. Prefill mode only: decode-time eviction never holds the whole context to repeat.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals

__all__ = ["KVzip"]

ALLOCATIONS = ("global", "uniform")
NORMALIZATIONS = ("chunk", "full")
GLOBAL = Selection(allocation="global", adaptive_floor=0.0)  # the paper's allocation: one entry a head at least


class KVzip(Policy):
    """Scores from context reconstruction (see the module docstring).

    Args:
        allocation: ``"global"`` (top scores over every layer and head, the paper's default) or
            ``"uniform"`` (the same budget for every head, through ``selection``).
        normalization: ``"chunk"`` (the paper's Algorithm 1) or ``"full"`` (softmax over the whole cache).
        chunk_size: context tokens repeated per reconstruction forward.
        tokenizer: the model's tokenizer, for the instruction and the chat template; when ``None`` the
            engine loads it from ``model.config.name_or_path``.
        window: unused by the scores (kept for the interface); 1 by default.
    """

    name = "kvzip"
    needs_reconstruction: ClassVar[bool] = True  # the engine runs kvsieve.engine.reconstruct before scoring
    uses_window = False
    comparable_across_heads = True  # attention probabilities of the same reconstruction queries
    comparable_across_layers = True  # the paper ranks every layer's and head's scores together

    def __init__(self, allocation: str = "global", normalization: str = "chunk", chunk_size: int = 2048,
                 tokenizer=None, window: int = 1, **kwargs) -> None:
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation {allocation!r} is not one of {', '.join(map(repr, ALLOCATIONS))}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization {normalization!r} is not one of {', '.join(map(repr, NORMALIZATIONS))}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.allocation = allocation
        self.normalization = normalization
        self.chunk_size = chunk_size
        self.tokenizer = tokenizer
        super().__init__(window=window, **kwargs)

    def reconstruction_key(self) -> tuple:
        """Policies with equal keys share one reconstruction of a cache (the grid computes it once)."""
        return (self.normalization, self.chunk_size)

    def score(self, signals: Signals) -> torch.Tensor:
        scores = signals.extra.get("reconstruction")
        if scores is None:
            raise ValueError(
                "kvzip scores come from a reconstruction forward of the model, which Signals cannot run: "
                "use kvsieve.attach(..., mode='prefill'), generate() or the grid runner, which compute "
                "Signals.extra['reconstruction'] (kvsieve.engine.reconstruct)"
            )
        scores = scores.float().clone()
        scores[..., : signals.extra.get("reconstruction_header", 0)] = float("inf")  # the template header
        return scores

    @staticmethod
    def global_kept_indices(scores: list[torch.Tensor], kept: int, protected_tail: int = 0
                            ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Pick ``len(scores) * kv_heads * kept`` entries over all layers and heads, per batch row.

        ``scores``: one (b, h, n) tensor per layer, all of the same length; the last ``protected_tail``
        entries of every head are kept on top of the budget. This is
        :meth:`~kvsieve.selection.Selection.allocate` with ``allocation="global"`` and no floor beyond one
        entry a head (the paper's). Returns per layer ``(indices, valid)``: (b, h, w) ascending indices,
        ``w`` the layer's widest head, and a (b, h, w) mask of the entries really kept (``None`` when
        every head keeps ``w``); the engine stores such layers ragged, so the bytes are the budget's.
        """
        b, h, n = scores[0].shape
        if any(s.shape != scores[0].shape for s in scores):
            raise ValueError("global allocation needs every layer's scores at the same length")
        context = n - protected_tail
        if not 1 <= kept <= context:
            raise ValueError(f"kept={kept} must be in [1, {context}]")
        # below every real score, above "never keep"; the tail's scores do not matter (it is protected)
        scores = [torch.nan_to_num(s.double(), nan=-1e300, neginf=-1e300) for s in scores]
        return GLOBAL.allocate(scores, [kept + protected_tail] * len(scores), protected_tail)

    def __repr__(self) -> str:
        return (f"KVzip(allocation={self.allocation!r}, normalization={self.normalization!r}, "
                f"chunk_size={self.chunk_size}, selection={self.selection})")
