"""A transformers cache layer that can be pruned physically, per head, and remembers original positions.

`SieveLayer` replaces ``DynamicLayer`` in a ``DynamicCache``. It reports the number of tokens the
layer has *seen* as its sequence length, so transformers keeps assigning the original positions
after entries are evicted, while the tensors it holds only contain the kept entries.

Two storage states:

* **dense**: ``keys``/``values`` (b, h, n, d), every KV head at the same length ``n``; ``valid``
  (b, h, n) masks entries that are padding (rows of a decode batch that hold fewer entries).
* **ragged** (:attr:`SieveLayer.heads`): one :class:`HeadEntries` per KV head, each at its own
  length; a head is padded only to the longest batch row *of that head*, with its valid entries
  first. A layer becomes ragged when a prune leaves its heads at different lengths (AdaKV's and
  KVzip's budgets), so every dropped entry is freed and :meth:`SieveLayer.nbytes` is what is stored.
  Attention reads the heads directly (``kvsieve.engine.attention``), so a ragged layer is only
  usable inside ``kvsieve.attach`` (``update`` refuses otherwise).

For code written against the dense layout, ``keys``, ``values``, ``positions``, ``valid`` and
``attention_received`` and ``entry_scores`` of a ragged layer read as a padded copy (each head left-padded to
the widest, the padding masked in ``valid``); assigning any of them turns the layer dense.

``entry_scores`` remembers, in decode mode, the scores of a policy whose score of an entry depends on that
entry alone (``Policy.intrinsic_scores``, e.g. kvzap): kept with the entries through every prune, NaN for
entries appended since, so the policy scores only those (they sit at the end of every head).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["HeadEntries", "SieveLayer", "clone_cache", "install", "sieve_layers", "cache_bytes", "full_cache_bytes",
           "stack_caches", "attached"]

_attached = [0]  # how many kvsieve.attach blocks are open (a ragged layer needs kvsieve's attention)


@contextlib.contextmanager
def attached() -> Iterator[None]:
    """Marks the block in which kvsieve's attention function is installed (entered by ``attach``)."""
    _attached[0] += 1
    try:
        yield
    finally:
        _attached[0] -= 1


@dataclass(frozen=True)
class HeadEntries:
    """The entries one KV head of a ragged layer holds (immutable: shallow cache copies share them).

    keys, values: (b, n, d); positions: (b, n) original positions; valid: (b, n) bool, ``None`` when
    every row holds all ``n`` (a row's padding sits after its entries of the last prune); attention: (b, n) float32
    accumulated attention, when tracked; scores: (b, n) float32 remembered scores (NaN: not scored yet), when kept.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None = None
    attention: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def rows(self, indices: torch.Tensor) -> HeadEntries:
        """Only the batch rows ``indices``, the padding no row needs any more dropped."""
        head = HeadEntries(*(None if t is None else t[indices] for t in
                             (self.keys, self.values, self.positions, self.valid, self.attention, self.scores)))
        return head if head.valid is None else head.trim()

    def trim(self) -> HeadEntries:
        """Each row's valid entries first (in order), then cut to the row holding the most."""
        n = self.valid.shape[1]
        width = int(self.valid.sum(-1).max()) if self.valid.numel() else 0
        order = ((~self.valid).long() * n + torch.arange(n, device=self.valid.device)).argsort(dim=-1)[:, :width]

        def take(t):
            if t is None:
                return None
            return t.gather(1, order[..., None].expand(-1, -1, t.shape[-1]) if t.dim() == 3 else order)

        cut = HeadEntries(*(take(t) for t in
                            (self.keys, self.values, self.positions, self.valid, self.attention, self.scores)))
        return replace(cut, valid=None) if bool(cut.valid.all()) else cut


def _pad(x: torch.Tensor, at: int, count: int, value=0) -> torch.Tensor:
    """Insert ``count`` entries of ``value`` before entry ``at`` (dim 1 of a (b, n, ...) tensor)."""
    if count == 0:
        return x
    filler = torch.full((x.shape[0], count, *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, :at], filler, x[:, at:]], dim=1)


class SieveLayer(DynamicLayer):
    """DynamicLayer + original positions, per-head (ragged) storage and attention statistics.

    Attributes:
        seen: tokens this layer has processed (logical length).
        positions: (b, h, n) original position of each cached entry.
        valid: (b, h, n) bool, ``None`` unless some entries are padding.
        heads: ``None`` (dense) or one :class:`HeadEntries` per KV head (ragged).
        recent_queries: (b, hq, <=w, d) the last queries the layer computed (the observation window).
        attention_received: (b, h, n) float32 accumulated attention, when tracking is on.
        entry_scores: (b, h, n) float32 a policy's remembered scores (NaN: appended since), decode mode only.
        query_stats: pre-RoPE query statistics (:class:`~kvsieve.query_stats.QueryStats`),
            collected only while a policy with ``needs_query_stats`` is attached.
        rope: (inv_freq, attention_scaling) of the layer's rotary embedding, set with ``query_stats``.
        hidden_states: (b, seen, hidden) the inputs of the layer's attention, one row per position, collected
            only while a policy with ``needs_hidden_states`` is attached (:mod:`kvsieve.engine.hidden_states`)
            and dropped by the first prune (the rows stop matching the entries).
    """

    def __init__(self, window: int = 64, track_attention: bool = False) -> None:
        self.heads: list[HeadEntries] | None = None
        self._positions = self._valid = self._attention = self._scores = None
        super().__init__()
        self.window = window
        self.track_attention = track_attention
        self.seen = 0
        self.recent_queries: torch.Tensor | None = None
        self.query_stats = None  # kvsieve.engine.query_stats fills it (pre-RoPE query statistics)
        self.rope: tuple[torch.Tensor, float] | None = None
        self.hidden_states: torch.Tensor | None = None

    # -- the dense view (a padded copy while ragged; assigning makes the layer dense) --------------
    def _field(self, name: str):
        if self.heads is None:
            return self.__dict__.get("_" + name)
        return self.padded()[name]

    def _set(self, name: str, value) -> None:
        if self.heads is not None:
            self.densify()
        self.__dict__["_" + name] = value

    keys = property(lambda self: self._field("keys"), lambda self, v: self._set("keys", v))
    values = property(lambda self: self._field("values"), lambda self, v: self._set("values", v))
    positions = property(lambda self: self._field("positions"), lambda self, v: self._set("positions", v))
    valid = property(lambda self: self._field("valid"), lambda self, v: self._set("valid", v))
    attention_received = property(lambda self: self._field("attention"), lambda self, v: self._set("attention", v))
    entry_scores = property(lambda self: self._field("scores"), lambda self, v: self._set("scores", v))

    @property
    def is_ragged(self) -> bool:
        return self.heads is not None

    @property
    def head_lengths(self) -> list[int]:
        """Entries stored per KV head (padding of batch rows included)."""
        if self.heads is not None:
            return [head.length for head in self.heads]
        return [self.physical_length] * (0 if self._keys is None or self._keys.dim() < 4 else self._keys.shape[1])

    def padded(self, pad_at: int = 0) -> dict[str, torch.Tensor | None]:
        """Dense (b, h, w, ...) copies of a ragged layer: each head padded to the widest, before entry
        ``pad_at`` (0: on the left, so the most recent entries of every head line up at the end; the
        sink count: the first ``pad_at`` and the last entries of every head line up)."""
        width = max(head.length for head in self.heads)
        out: dict[str, list] = {name: [] for name in ("keys", "values", "positions", "valid", "attention", "scores")}
        for head in self.heads:
            at, count = min(pad_at, head.length), width - head.length
            valid = head.valid if head.valid is not None else torch.ones_like(head.positions, dtype=torch.bool)
            out["keys"].append(_pad(head.keys, at, count))
            out["values"].append(_pad(head.values, at, count))
            out["positions"].append(_pad(head.positions, at, count))
            out["valid"].append(_pad(valid, at, count, False))
            if head.attention is not None:
                out["attention"].append(_pad(head.attention, at, count))
            if head.scores is not None:  # padding reads as scored (it is masked): NaN marks only appended entries
                out["scores"].append(_pad(head.scores, at, count))
        dense = {name: torch.stack(parts, 1) if parts else None for name, parts in out.items()}
        if bool(dense["valid"].all()):
            dense["valid"] = None
        return dense

    def densify(self, pad_at: int = 0) -> None:
        """Turn a ragged layer dense (see :meth:`padded`); a no-op on a dense layer."""
        if self.heads is None:
            return
        dense = self.padded(pad_at)
        self.heads = None
        for name, value in dense.items():
            self.__dict__["_" + name] = value

    def _compact(self) -> None:
        """After a prune: drop masked entries; heads left at different lengths make the layer ragged."""
        valid = self._valid
        if valid is None:
            return
        counts = valid.sum(-1)  # (b, h)
        widths = counts.amax(0).tolist()
        n = valid.shape[-1]
        # valid entries first, in their order: a stable sort on "is padding"
        order = ((~valid).long() * n + torch.arange(n, device=valid.device)).argsort(dim=-1)
        fields = {"keys": self._keys, "values": self._values, "positions": self._positions,
                  "valid": valid, "attention": self._attention, "scores": self._scores}
        heads = []
        for i, width in enumerate(widths):
            index = order[:, i, :width]
            parts = {}
            for name, tensor in fields.items():
                if tensor is None:
                    parts[name] = None
                elif tensor.dim() == 4:
                    parts[name] = tensor[:, i].gather(1, index[..., None].expand(-1, -1, tensor.shape[-1]))
                else:
                    parts[name] = tensor[:, i].gather(1, index)
            if bool(parts["valid"].all()):
                parts["valid"] = None
            heads.append(HeadEntries(parts["keys"].contiguous(), parts["values"].contiguous(), parts["positions"],
                                     parts["valid"], parts["attention"], parts["scores"]))
        if len(set(widths)) == 1:  # every head at one length: stay dense (padding only between rows)
            self.__dict__.update(_keys=torch.stack([h.keys for h in heads], 1),
                                 _values=torch.stack([h.values for h in heads], 1),
                                 _positions=torch.stack([h.positions for h in heads], 1),
                                 _attention=None if self._attention is None else torch.stack(
                                     [h.attention for h in heads], 1),
                                 _scores=None if self._scores is None else torch.stack([h.scores for h in heads], 1))
            masks = [h.valid if h.valid is not None else torch.ones_like(h.positions, dtype=torch.bool)
                     for h in heads]
            stacked = torch.stack(masks, 1)
            self._valid = None if bool(stacked.all()) else stacked
            return
        self.heads = heads
        for name in ("keys", "values", "positions", "valid", "attention", "scores"):
            self.__dict__["_" + name] = None

    # -- the cache protocol ---------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b, h, q, _ = key_states.shape
        new_positions = torch.arange(self.seen, self.seen + q, device=key_states.device).expand(b, h, q)
        if self.heads is not None:
            if not _attached[0]:
                raise RuntimeError("this kvsieve cache holds its heads at different lengths (ragged): run the "
                                   "model on it inside kvsieve.attach(), whose attention function reads them")
            heads = []
            for i, head in enumerate(self.heads):
                ones = torch.ones(b, q, dtype=torch.bool, device=key_states.device)
                heads.append(HeadEntries(
                    torch.cat([head.keys, key_states[:, i]], 1),
                    torch.cat([head.values, value_states[:, i]], 1),
                    torch.cat([head.positions, new_positions[:, i]], 1),
                    None if head.valid is None else torch.cat([head.valid, ones], 1),
                    None if head.attention is None else torch.cat(
                        [head.attention, torch.zeros(b, q, dtype=torch.float32, device=key_states.device)], 1),
                    None if head.scores is None else torch.cat(
                        [head.scores, torch.full((b, q), math.nan, device=key_states.device)], 1),
                ))
            self.heads = heads
            self.seen += q
            return key_states, value_states  # the attention function reads self.heads
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self._positions = new_positions if self._positions is None else torch.cat([self._positions, new_positions], -1)
        if self._valid is not None:
            self._valid = torch.cat([self._valid, torch.ones(b, h, q, dtype=torch.bool, device=self._valid.device)], -1)
        if self.track_attention:
            zeros = torch.zeros(b, h, q, dtype=torch.float32, device=key_states.device)
            self._attention = zeros if self._attention is None else torch.cat([self._attention, zeros], -1)
        if self._scores is not None:
            self._scores = torch.cat([self._scores, torch.full((b, h, q), math.nan, device=key_states.device)], -1)
        self.seen += q
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.physical_length + query_length, 0

    @property
    def physical_length(self) -> int:
        """Entries per head held (the widest head of a ragged layer)."""
        if self.heads is not None:
            return max(head.length for head in self.heads)
        return 0 if not self.is_initialized or self._keys is None or self._keys.numel() == 0 else self._keys.shape[-2]

    def remember_queries(self, queries: torch.Tensor) -> None:
        """Keep the last ``window`` queries (called by the attention function)."""
        if self.recent_queries is None or queries.shape[-2] >= self.window:
            self.recent_queries = queries[..., -self.window :, :].detach()
        else:
            self.recent_queries = torch.cat([self.recent_queries, queries.detach()], -2)[..., -self.window :, :]

    def prune(self, indices: torch.Tensor, valid: torch.Tensor | None = None, pad_at: int = 0) -> None:
        """Keep only ``indices`` (b, h, k) of each head (``valid`` (b, h, k): which of them are real).

        New tensors, so the old memory is freed. On a ragged layer the indices refer to
        :meth:`padded` with the same ``pad_at``. Heads left at different lengths are stored ragged.
        """
        self.densify(pad_at)
        self.hidden_states = None  # one row per position no longer: the heads keep different entries
        gather = indices.unsqueeze(-1).expand(-1, -1, -1, self._keys.shape[-1])
        self._keys = self._keys.gather(2, gather).contiguous()
        self._values = self._values.gather(2, gather).contiguous()
        self._positions = self._positions.gather(2, indices)
        if self._attention is not None:
            self._attention = self._attention.gather(2, indices)
        if self._scores is not None:
            self._scores = self._scores.gather(2, indices)
        if self._valid is not None:
            valid = self._valid.gather(2, indices) if valid is None else valid & self._valid.gather(2, indices)
        self._valid = None if valid is None or bool(valid.all()) else valid
        self._compact()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (a decode batch dropping its finished rows)."""
        if self.heads is not None:
            self.heads = [head.rows(indices) for head in self.heads]
        else:
            super().batch_select_indices(indices)
            for name in ("_positions", "_valid", "_attention", "_scores"):
                value = self.__dict__.get(name)
                if value is not None:
                    self.__dict__[name] = value[indices]
        for name in ("recent_queries", "query_stats", "hidden_states"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a pruned kvsieve cache cannot be cropped")

    def reset(self) -> None:
        self.heads = None
        super().reset()
        self.seen = 0
        self._positions = self._valid = self._attention = self._scores = self.recent_queries = None
        self.query_stats = self.rope = self.hidden_states = None

    def nbytes(self) -> int:
        """Bytes of the keys and values stored (every head's own length; batch padding included)."""
        if self.heads is not None:
            return sum(h.keys.numel() * h.keys.element_size() + h.values.numel() * h.values.element_size()
                       for h in self.heads)
        if self.physical_length == 0:
            return 0
        return self._keys.numel() * self._keys.element_size() + self._values.numel() * self._values.element_size()

    def entry_bytes(self) -> int:
        """Bytes of one key and one value of one head and batch row."""
        if self.heads is not None:
            k = self.heads[0].keys
            return 2 * k.shape[-1] * k.element_size()
        return 0 if self._keys is None or self._keys.dim() < 4 else 2 * self._keys.shape[-1] * self._keys.element_size()

    def batch_size(self) -> int:
        return self.heads[0].keys.shape[0] if self.heads is not None else self._keys.shape[0]

    def num_heads(self) -> int:
        return len(self.heads) if self.heads is not None else self._keys.shape[1]


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


def _dense_bytes(layer) -> int:
    if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
        return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return 0


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes held by the keys and values of every layer (pruned or not, ragged heads at their own length)."""
    return sum(layer.nbytes() if isinstance(layer, SieveLayer) else _dense_bytes(layer) for layer in cache.layers)


def full_cache_bytes(cache: DynamicCache) -> int:
    """Bytes the keys and values would take had no entry been evicted: every token a layer has seen."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, SieveLayer):
            if layer.physical_length:
                total += layer.entry_bytes() * layer.num_heads() * layer.batch_size() * layer.seen
        else:
            total += _dense_bytes(layer)
    return total


def _as_heads(layer: SieveLayer) -> list[HeadEntries]:
    if layer.heads is not None:
        return layer.heads
    valid = layer.valid
    return [HeadEntries(layer.keys[:, i], layer.values[:, i], layer.positions[:, i],
                        None if valid is None else valid[:, i]) for i in range(layer.num_heads())]


def stack_caches(caches: list[DynamicCache]) -> DynamicCache:
    """Concatenate pruned caches along the batch dimension, for decoding (no further compression).

    Each KV head is padded only to the longest row *of that head* (the padding masked), so a batch
    of ragged caches stays ragged; every row decodes as it would alone. Window queries, query
    statistics, attention tracking and remembered scores are dropped.
    """
    stacked = copy.copy(caches[0])
    stacked.layers = [copy.copy(layer) for layer in caches[0].layers]
    for i, layer in enumerate(stacked.layers):
        parts = [c.layers[i] for c in caches]
        if not isinstance(layer, SieveLayer):
            layer.keys = torch.cat([p.keys for p in parts])
            layer.values = torch.cat([p.values for p in parts])
            continue
        per_row = [_as_heads(p) for p in parts]
        heads = []
        for h in range(len(per_row[0])):
            row_heads = [r[h] for r in per_row]
            width = max(x.length for x in row_heads)
            pads = [width - x.length for x in row_heads]

            def cat(name: str, value=0, rows=row_heads, pads=pads):
                return torch.cat([torch.nn.functional.pad(getattr(x, name), (0, 0, 0, p) if name in ("keys", "values")
                                                          else (0, p), value=value) for x, p in zip(rows, pads)])

            valid = torch.cat([torch.nn.functional.pad(
                x.valid if x.valid is not None else torch.ones_like(x.positions, dtype=torch.bool), (0, p),
                value=False) for x, p in zip(row_heads, pads)])
            heads.append(HeadEntries(cat("keys"), cat("values"), cat("positions"),
                                     None if bool(valid.all()) else valid))
        layer.heads = None
        layer.__dict__.update(_keys=None, _values=None, _positions=None, _valid=None, _attention=None, _scores=None)
        if len({x.length for x in heads}) == 1:
            layer.__dict__.update(_keys=torch.stack([x.keys for x in heads], 1),
                                  _values=torch.stack([x.values for x in heads], 1),
                                  _positions=torch.stack([x.positions for x in heads], 1))
            masks = [x.valid if x.valid is not None else torch.ones_like(x.positions, dtype=torch.bool)
                     for x in heads]
            mask = torch.stack(masks, 1)
            layer.__dict__["_valid"] = None if bool(mask.all()) else mask
        else:
            layer.heads = heads
        layer.recent_queries = layer.query_stats = layer.hidden_states = None
        layer.track_attention = False
    return stacked


def clone_cache(cache: DynamicCache) -> DynamicCache:
    """A cache that can be pruned or extended without touching ``cache``.

    Pruning and appending make new tensors, so the layers' tensors are shared (a ragged layer's
    :class:`HeadEntries` are immutable); only the attention accumulator, which the attention function
    adds to in place, is copied, and a ragged layer stays ragged.
    """
    clone = copy.copy(cache)
    clone.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in clone.layers:
        if not isinstance(layer, SieveLayer):
            continue
        if layer.heads is not None:
            layer.heads = [h if h.attention is None else replace(h, attention=h.attention.clone()) for h in layer.heads]
        elif layer.__dict__.get("_attention") is not None:
            layer.__dict__["_attention"] = layer.__dict__["_attention"].clone()
    return clone
