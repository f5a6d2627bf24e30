"""What a policy may see about one attention layer, computed lazily and at most once.

A policy never touches the model: it gets a :class:`Signals` for one layer and returns one score
per cached entry and KV head. Everything here is derived from the layer's cache and the queries
the engine captured while the layer ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvsieve.query_stats import QueryStats

__all__ = ["Signals"]


@dataclass(eq=False)
class Signals:
    """Per-layer inputs of a policy.

    Shapes: ``b`` batch, ``h`` KV heads, ``g`` query heads per KV head, ``n`` cached entries,
    ``w`` observation window, ``d`` head dim.

    Attributes:
        keys: (b, h, n, d) cached keys, rotary embedding applied.
        values: (b, h, n, d) cached values.
        window_queries: (b, h*g, w, d) queries of the last ``w`` tokens the layer processed.
        positions: (b, h, n) original token position of each cached entry.
        layer_idx, num_layers: where this layer sits in the model.
        scaling: softmax scale the model uses (usually ``d ** -0.5``).
        attention_received: (b, h, n) attention each entry received from every query the layer
            processed so far (summed over queries and grouped query heads), when the engine was asked
            to accumulate it (policies with ``needs_accumulated_attention``), else ``None``.
        protected_tail: number of trailing entries the engine will keep whatever the scores say
            (e.g. the question in question-aware mode).
        query_stats: running statistics of the layer's queries *before* the rotary embedding, over
            every query it processed (:meth:`query_moments` reads them), when the engine was asked to
            collect them (policies with ``needs_query_stats``), else ``None``.
        rope_inv_freq: (r/2,) inverse frequencies of the layer's rotary embedding (it rotates the
            first ``r`` of the ``d`` dims, in halves, as transformers' ``rotate_half``), or ``None``.
        rope_attention_scaling: factor the model applies to its rotary cos/sin (1 unless YaRN-like).
        hidden_states: (b, n, hidden) the input of the layer's attention at each cached position (the
            decoder layer's normed hidden state), when the engine was asked to keep them (policies with
            ``needs_hidden_states``, prefill compression only), else ``None``.
        entry_scores: (b, h, n) this policy's scores of the cached entries from earlier evictions, NaN for the
            entries appended since (decode mode, policies with ``intrinsic_scores``), else ``None``.
        next_position: position the next query will take (tokens the layer has seen); ``None``: one
            past the last cached position.
    """

    keys: torch.Tensor
    values: torch.Tensor
    window_queries: torch.Tensor
    positions: torch.Tensor
    layer_idx: int
    num_layers: int
    scaling: float
    attention_received: torch.Tensor | None = None
    protected_tail: int = 0
    query_stats: QueryStats | None = None
    rope_inv_freq: torch.Tensor | None = None
    rope_attention_scaling: float = 1.0
    next_position: int | None = None
    hidden_states: torch.Tensor | None = None
    entry_scores: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.keys.shape[-2]
        if n == 0:
            raise ValueError("Signals got an empty cache: the context has no tokens")
        if self.window_queries.shape[-2] > n:
            raise ValueError(
                f"observation window of {self.window_queries.shape[-2]} queries is larger than the {n} cached entries;"
                " use a window <= the context length"
            )

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def seq_len(self) -> int:
        return self.keys.shape[2]

    @property
    def window_size(self) -> int:
        return self.window_queries.shape[-2]

    @property
    def num_groups(self) -> int:
        return self.window_queries.shape[1] // self.num_kv_heads

    @property
    def future_position(self) -> int:
        """Position of the next query: ``next_position``, else one past the last cached position."""
        return self.next_position if self.next_position is not None else int(self.positions.amax()) + 1

    def query_moments(self, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, h*g, d) mean and (b, h*g, d, d) covariance of the pre-RoPE queries at positions ``>= skip``."""
        if self.query_stats is None:
            raise RuntimeError("no query statistics: run the policy through kvsieve.attach() with needs_query_stats")
        return self.query_stats.moments(skip)

    @cached_property
    def window_attention(self) -> torch.Tensor:
        """(b, h*g, w, n) softmax attention of the window queries over the cache, in float32.

        The window's own keys are the last ``w`` entries; a window query does not see later
        window entries (causal), exactly as in the forward pass.
        """
        b, hq, w, d = self.window_queries.shape
        h, g = self.num_kv_heads, self.num_groups
        # group the query heads of each KV head instead of repeating the keys; scale the (small) queries
        queries = (self.window_queries.float() * self.scaling).reshape(b, h, g * w, d)
        logits = torch.matmul(queries, self.keys.float().transpose(-1, -2)).view(b, hq, w, -1)
        future = torch.triu(torch.ones(w, w, dtype=torch.bool, device=logits.device), diagonal=1)
        logits[..., -w:].masked_fill_(future, float("-inf"))
        return torch.softmax(logits, dim=-1)

    @cached_property
    def window_attention_kv(self) -> torch.Tensor:
        """(b, h, w, n) window attention averaged over the query heads that share a KV head."""
        b, hq, w, n = self.window_attention.shape
        return self.window_attention.reshape(b, self.num_kv_heads, self.num_groups, w, n).mean(dim=2)

    @cached_property
    def key_norms(self) -> torch.Tensor:
        """(b, h, n) L2 norm of each key."""
        return self.keys.float().norm(dim=-1)

    @cached_property
    def value_norms(self) -> torch.Tensor:
        """(b, h, n) L2 norm of each value."""
        return self.values.float().norm(dim=-1)

    @cached_property
    def relative_positions(self) -> torch.Tensor:
        """(b, h, n) position of each entry scaled to [0, 1] (0 = first token seen, 1 = last)."""
        pos = self.positions.float()
        last = pos.amax(dim=-1, keepdim=True).clamp_min(1.0)
        return pos / last
