"""A transformers cache layer that can be pruned physically and remembers original positions.

`SieveLayer` replaces ``DynamicLayer`` in a ``DynamicCache``. It reports the number of tokens the
layer has *seen* as its sequence length, so transformers keeps assigning the original positions
after entries are evicted, while the tensors it holds only contain the kept entries.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["SieveLayer", "install", "sieve_layers", "cache_bytes", "full_cache_bytes"]


class SieveLayer(DynamicLayer):
    """DynamicLayer + original positions, optional per-head validity mask and attention statistics.

    Attributes:
        seen: tokens this layer has processed (logical length).
        positions: (b, h, n) original position of each cached entry.
        valid: (b, h, n) bool, ``None`` unless heads keep different numbers of entries.
        recent_queries: (b, hq, <=w, d) the last queries the layer computed (the observation window).
        attention_received: (b, h, n) float32 accumulated attention, when tracking is on.
        query_stats: pre-RoPE query statistics (:class:`~kvsieve.engine.query_stats.QueryStats`),
            collected only while a policy with ``needs_query_stats`` is attached.
        rope: (inv_freq, attention_scaling) of the layer's rotary embedding, set with ``query_stats``.
    """

    def __init__(self, window: int = 64, track_attention: bool = False) -> None:
        super().__init__()
        self.window = window
        self.track_attention = track_attention
        self.seen = 0
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.recent_queries: torch.Tensor | None = None
        self.attention_received: torch.Tensor | None = None
        self.query_stats = None  # kvsieve.engine.query_stats fills it (pre-RoPE query statistics)
        self.rope: tuple[torch.Tensor, float] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b, h, q, _ = key_states.shape
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        new_positions = torch.arange(self.seen, self.seen + q, device=key_states.device).expand(b, h, q)
        self.positions = new_positions if self.positions is None else torch.cat([self.positions, new_positions], -1)
        if self.valid is not None:
            self.valid = torch.cat([self.valid, torch.ones(b, h, q, dtype=torch.bool, device=self.valid.device)], -1)
        if self.track_attention:
            zeros = torch.zeros(b, h, q, dtype=torch.float32, device=key_states.device)
            self.attention_received = (
                zeros if self.attention_received is None else torch.cat([self.attention_received, zeros], -1)
            )
        self.seen += q
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.physical_length + query_length, 0

    @property
    def physical_length(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def remember_queries(self, queries: torch.Tensor) -> None:
        """Keep the last ``window`` queries (called by the attention function)."""
        if self.recent_queries is None or queries.shape[-2] >= self.window:
            self.recent_queries = queries[..., -self.window :, :].detach()
        else:
            self.recent_queries = torch.cat([self.recent_queries, queries.detach()], -2)[..., -self.window :, :]

    def prune(self, indices: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep only ``indices`` (b, h, k) of each head; new tensors, so the old memory is freed."""
        gather = indices.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather).contiguous()
        self.values = self.values.gather(2, gather).contiguous()
        self.positions = self.positions.gather(2, indices)
        if self.attention_received is not None:
            self.attention_received = self.attention_received.gather(2, indices)
        if self.valid is not None:
            valid = self.valid.gather(2, indices) if valid is None else valid & self.valid.gather(2, indices)
        self.valid = None if valid is None or bool(valid.all()) else valid

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (a decode batch dropping its finished rows)."""
        super().batch_select_indices(indices)
        for name in ("positions", "valid", "recent_queries", "attention_received", "query_stats"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a pruned kvsieve cache cannot be cropped")

    def reset(self) -> None:
        super().reset()
        self.seen = 0
        self.positions = self.valid = self.recent_queries = self.attention_received = None
        self.query_stats = self.rope = None

    def nbytes(self) -> int:
        if self.physical_length == 0:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def install(cache: DynamicCache, window: int, track_attention: bool) -> DynamicCache:
    """Swap every full-attention ``DynamicLayer`` of an empty cache for a ``SieveLayer``.

    Sliding-window layers (Gemma3's local layers) are left alone: they already bound their size.
    Returns the same cache object, so code holding a reference (``generate``) keeps working.
    """
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            if layer.get_seq_length() > 0:
                raise ValueError("kvsieve needs a fresh cache: this one already holds tokens from outside attach()")
            cache.layers[i] = SieveLayer(window=window, track_attention=track_attention)
    return cache


def sieve_layers(cache: DynamicCache) -> list[tuple[int, SieveLayer]]:
    return [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, SieveLayer)]


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes held by the keys and values of every layer (pruned or not)."""
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return total


def full_cache_bytes(cache: DynamicCache) -> int:
    """Bytes the keys and values would take had no entry been evicted: every token a layer has seen."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, SieveLayer):
            if layer.physical_length:
                total += layer.nbytes() // layer.physical_length * layer.seen
        elif getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return total
