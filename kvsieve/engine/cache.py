"""A transformers cache layer that can be pruned physically, per head, and remembers original positions.

`SieveLayer` replaces ``DynamicLayer`` in a ``DynamicCache``. It reports the number of tokens the
layer has *seen* as its sequence length, so transformers keeps assigning the original positions
after entries are evicted, while the tensors it holds only contain the kept entries.

Two storage states:

* **dense**: ``keys``/``values`` (b, h, n, d), every KV head at the same length ``n``; ``valid``
  (b, h, n) masks entries that are padding. The prompt's forward fills a layer in this state, and
  policies score it in this state.
* **stored** (:attr:`SieveLayer.store`, a :class:`~kvsieve.engine.ragged.RaggedStore`): one segment per
  (batch row, KV head) in one buffer, each at its own length with spare capacity after it. A prune that
  leaves heads (or rows) at different lengths (AdaKV's and KVzip's budgets) stores the layer this way, so
  every dropped entry is freed and :meth:`SieveLayer.nbytes` is what is allocated; the first append under
  ``kvsieve.attach`` after the prompt moves any layer here, so later tokens are written in place instead of
  concatenating the whole layer. Attention reads the store directly (``kvsieve.engine.attention``), so a
  stored layer is only usable inside ``kvsieve.attach`` (``update`` refuses otherwise).

For code written against the dense layout, ``keys``, ``values``, ``positions``, ``valid``,
``attention_received`` and ``entry_scores`` of a stored layer read as a view (every segment at one length)
or a padded copy (each segment left-padded to the widest, the padding masked in ``valid``); assigning any of
them turns the layer dense.

``entry_scores`` remembers, in decode mode, the scores of a policy whose score of an entry depends on that
entry alone (``Policy.intrinsic_scores``, e.g. kvzap): kept with the entries through every prune, NaN for
entries appended since, so the policy scores only those (they sit at the end of every head).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvsieve.engine.ragged import RaggedStore, spare_for

__all__ = ["HeadEntries", "SieveLayer", "clone_cache", "install", "sieve_layers", "cache_bytes",
           "cache_allocated_bytes", "full_cache_bytes", "stack_caches", "attached", "reserve_room"]

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
    """A copy of the entries one KV head of a ragged layer holds (:attr:`SieveLayer.heads`).

    keys, values: (b, n, d); positions: (b, n) original positions; valid: (b, n) bool, ``None`` when
    every row holds all ``n`` (a row's padding sits after its entries); attention: (b, n) float32
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


class SieveLayer(DynamicLayer):
    """DynamicLayer + original positions, per-head (ragged) storage and attention statistics.

    Attributes:
        seen: tokens this layer has processed (logical length).
        positions: (b, h, n) original position of each cached entry.
        valid: (b, h, n) bool, ``None`` unless some entries are padding.
        store: ``None`` (dense) or the layer's :class:`~kvsieve.engine.ragged.RaggedStore` (segments that grow
            in place; ragged when they differ in length).
        spare: entries of spare room a segment gets when it must grow (``None``: an eighth of its length, at
            least 64); decode-time eviction sets it to ``evict_every``, the most it grows between evictions.
        budget: decode-time eviction: the entries per head (their mean over the heads) an eviction keeps the layer
            at, set by the reader that holds it there (``attach(mode="decode")``); ``None`` otherwise.
        grow_in_place: whether an update of a dense layer that already holds entries moves it into a store
            (kvsieve's attention reads stores); KVzip's reconstruction turns it off on its throwaway copies,
            whose attention function wants every key returned by ``update``.
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
        self.store: RaggedStore | None = None
        self._positions = self._valid = self._attention = self._scores = None
        super().__init__()
        self.window = window
        self.track_attention = track_attention
        self.grow_in_place = True
        self.spare: int | None = None
        self.budget: int | None = None
        self.seen = 0
        self.recent_queries: torch.Tensor | None = None
        self.query_stats = None  # kvsieve.engine.query_hooks fills it (pre-RoPE query statistics)
        self.rope: tuple[torch.Tensor, float] | None = None
        self.hidden_states: torch.Tensor | None = None
        self.recall = None  # engine/recall.LayerRecall: called by the attention function, once, before attention

    # -- the dense view (a view or padded copy of a store; assigning makes the layer dense) -------
    def _field(self, name: str):
        if self.store is None:
            return self.__dict__.get("_" + name)
        view = self.store.dense_view()
        if view is not None and name in ("keys", "values"):
            return view[0] if name == "keys" else view[1]
        return self.padded()[name]

    def _set(self, name: str, value) -> None:
        if self.store is not None:
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
        """Whether the layer's heads (or rows) hold different numbers of entries, each stored at its own length."""
        return self.store is not None and not self.store.uniform

    @property
    def heads(self) -> list[HeadEntries] | None:
        """Per KV head, a copy of its entries (each row's entries first, then its padding); ``None`` unless ragged."""
        if not self.is_ragged:
            return None
        store = self.store
        out = []
        for i, width in enumerate(store.head_lengths()):
            index, valid = store.padded_index(width, pad_at=width)
            index, valid = index[:, i], valid[:, i]
            out.append(HeadEntries(store.keys[index], store.values[index], store.positions[index],
                                   None if bool(valid.all()) else valid,
                                   None if store.attention is None else store.attention[index],
                                   None if store.scores is None else store.scores[index]))
        return out

    @property
    def head_lengths(self) -> list[int]:
        """Entries stored per KV head (its longest row)."""
        if self.store is not None:
            return self.store.head_lengths()
        return [self.physical_length] * (0 if self._keys is None or self._keys.dim() < 4 else self._keys.shape[1])

    def padded(self, pad_at: int = 0) -> dict[str, torch.Tensor | None]:
        """Dense (b, h, w, ...) copies of a stored layer: every (row, head) padded to the widest, before entry
        ``pad_at`` (0: on the left, so the most recent entries line up at the end; the sink count: the first
        ``pad_at`` and the last entries line up)."""
        return self.store.padded(pad_at)

    def densify(self, pad_at: int = 0) -> None:
        """Turn a stored layer dense (see :meth:`padded`); a no-op on a dense layer."""
        if self.store is None:
            return
        dense = self.padded(pad_at)
        self.store = None
        for name, value in dense.items():
            self.__dict__["_" + name] = value

    def _to_store(self, spare: int | None = None) -> None:
        """Move the dense tensors into a store (masked entries dropped); the dense fields are cleared."""
        self.store = RaggedStore.from_dense(self._keys, self._values, self._positions, self._valid,
                                            self._attention, self._scores, spare)
        for name in ("keys", "values", "positions", "valid", "attention", "scores"):
            self.__dict__["_" + name] = None

    def _compact(self) -> None:
        """After a prune: masked entries dropped; heads (or rows) left at different lengths are stored ragged,
        one segment per (row, head) at its own length. A layer whose every head and row holds the same
        entries count stays dense."""
        if self._valid is None:
            return
        counts = self._valid.sum(-1)
        if bool((counts == counts.flatten()[0]).all()):
            keep = self._valid
            n = int(counts.flatten()[0])
            order = ((~keep).long() * keep.shape[-1] + torch.arange(keep.shape[-1], device=keep.device)).argsort(-1)
            order = order[..., :n]

            def take(t):
                if t is None:
                    return None
                return t.gather(2, order[..., None].expand(-1, -1, -1, t.shape[-1])) if t.dim() == 4 \
                    else t.gather(2, order)

            for name in ("keys", "values", "positions", "attention", "scores"):
                self.__dict__["_" + name] = take(self.__dict__["_" + name])
            self._valid = None
            return
        self._to_store()

    # -- the cache protocol ---------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b, h, q, _ = key_states.shape
        new_positions = torch.arange(self.seen, self.seen + q, device=key_states.device).expand(b, h, q)
        if self.store is None and self.grow_in_place and _attached[0] and self.physical_length > 0:
            room = spare_for(self.physical_length + q) if self.spare is None else self.spare
            self._to_store(spare=q + room)  # grows in place from now on
        if self.store is not None:
            if not _attached[0]:
                raise RuntimeError("this kvsieve cache keeps its entries in per-head segments: run the model on it "
                                   "inside kvsieve.attach(), whose attention function reads them")
            self.store = self.store.append(key_states, value_states, new_positions, self.spare)
            self.seen += q
            return key_states, value_states  # the attention function reads self.store
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
        """Entries per head held (the widest head and row of a stored layer)."""
        if self.store is not None:
            return self.store.width
        return 0 if not self.is_initialized or self._keys is None or self._keys.numel() == 0 else self._keys.shape[-2]

    def remember_queries(self, queries: torch.Tensor) -> None:
        """Keep the last ``window`` queries (called by the attention function)."""
        if self.recent_queries is None or queries.shape[-2] >= self.window:
            self.recent_queries = queries[..., -self.window :, :].detach()
        else:
            self.recent_queries = torch.cat([self.recent_queries, queries.detach()], -2)[..., -self.window :, :]

    def prune(self, indices: torch.Tensor, valid: torch.Tensor | None = None, pad_at: int = 0) -> None:
        """Keep only ``indices`` (b, h, k) of each head (``valid`` (b, h, k): which of them are real).

        New tensors, so the old memory is freed. On a stored layer the indices refer to :meth:`padded` with
        the same ``pad_at``. Heads left at different lengths are stored ragged.
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

    def insert_before_tail(self, tail: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                           valid: torch.Tensor) -> None:
        """Put entries (b, h, r, ...) (``valid`` (b, h, r): which are real) before each head's last ``tail`` entries:
        recalled entries go back at their own positions, ahead of the new tokens that recalled them (every key
        before a query's own block stays visible to it under the bottom-right causal mask). One copy of the layer."""
        # a stored layer keeps the room it had (a server charged the request for it; growing would pass the charge)
        room = None if self.store is None else int((self.store.capacity - self.store.lengths).min())
        self.densify(pad_at=0)  # padding on the left: every head's last ``tail`` entries line up at the end
        self.hidden_states = None
        n = self._keys.shape[2]
        if not 0 < tail <= n:
            raise ValueError(f"tail {tail} is not within the layer's {n} entries")
        b, h = self._keys.shape[:2]
        held = self._valid if self._valid is not None else torch.ones(b, h, n, dtype=torch.bool,
                                                                     device=self._keys.device)

        def spliced(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return torch.cat([old[:, :, :n - tail], new.to(old.device, old.dtype), old[:, :, n - tail:]], dim=2)

        self._keys, self._values = spliced(self._keys, keys), spliced(self._values, values)
        self._positions = spliced(self._positions, positions)
        self._valid = spliced(held, valid)
        if self._attention is not None:
            self._attention = spliced(self._attention, torch.zeros(valid.shape))
        if self._scores is not None:
            self._scores = spliced(self._scores, torch.full(valid.shape, math.nan))
        if room is None:
            self._compact()
        else:
            self._to_store(spare=room)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (a decode batch dropping its finished rows)."""
        if self.store is not None:
            self.store = self.store.select_rows(indices)
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
        self.store = None
        super().reset()
        self.seen = 0
        self._positions = self._valid = self._attention = self._scores = self.recent_queries = None
        self.query_stats = self.rope = self.hidden_states = None

    def nbytes(self) -> int:
        """Bytes of the keys and values of the entries held (a stored layer: every segment's own length; a dense
        one: its tensors, masked padding included)."""
        if self.store is not None:
            return self.store.nbytes()
        if self.physical_length == 0:
            return 0
        return self._keys.numel() * self._keys.element_size() + self._values.numel() * self._values.element_size()

    def allocated_bytes(self) -> int:
        """Bytes of memory the keys and values take: :meth:`nbytes` plus a stored layer's spare room."""
        return self.store.allocated_bytes() if self.store is not None else self.nbytes()

    def entry_bytes(self) -> int:
        """Bytes of one key and one value of one head and batch row."""
        if self.store is not None:
            return self.store.entry_bytes()
        return 0 if self._keys is None or self._keys.dim() < 4 else 2 * self._keys.shape[-1] * self._keys.element_size()

    def batch_size(self) -> int:
        return self.store.rows if self.store is not None else self._keys.shape[0]

    def num_heads(self) -> int:
        return self.store.heads if self.store is not None else self._keys.shape[1]


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


def reserve_room(cache: DynamicCache, tokens: int) -> DynamicCache:
    """Give every (row, KV head) of every kvsieve layer room for ``tokens`` more entries, so decoding that many
    tokens appends in place and allocates nothing: a server reserves each request's ``max_tokens`` this way and
    charges :func:`cache_allocated_bytes`, which then holds for the whole request. Returns ``cache``."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
    for _, layer in sieve_layers(cache):
        if layer.store is not None:
            layer.store = layer.store.with_room(tokens)
        elif layer.physical_length:
            layer._to_store(spare=tokens)
    return cache


def sieve_layers(cache: DynamicCache) -> list[tuple[int, SieveLayer]]:
    return [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, SieveLayer)]


def _dense_bytes(layer) -> int:
    if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
        return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return 0


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes of the keys and values of the entries every layer holds (pruned or not, ragged heads at their own
    length): what results report and compare."""
    return sum(layer.nbytes() if isinstance(layer, SieveLayer) else _dense_bytes(layer) for layer in cache.layers)


def cache_allocated_bytes(cache: DynamicCache) -> int:
    """Bytes of memory the cache's keys and values take: :func:`cache_bytes` plus the spare room of segments that
    grow in place (at most an eighth, or 64 entries, per segment; ``evict_every`` in decode mode). What a memory
    budget must charge."""
    return sum(layer.allocated_bytes() if isinstance(layer, SieveLayer) else _dense_bytes(layer)
               for layer in cache.layers)


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


def _as_store(layer: SieveLayer) -> RaggedStore:
    if layer.store is not None:
        return layer.store
    return RaggedStore.from_dense(layer.keys, layer.values, layer.positions, layer.valid, None, layer.entry_scores)


def stack_caches(caches: list[DynamicCache], keep_scores: bool = False) -> DynamicCache:
    """Concatenate pruned caches along the batch dimension, for decoding.

    Every (row, KV head) keeps its own length (a segment of the layer's store), so a batch of ragged
    caches stays ragged and every row decodes as it would alone. Window queries, query statistics and
    attention tracking are dropped; remembered scores too, unless ``keep_scores`` (a server that evicts rows
    again while decoding: a row without them gets NaN, "not scored yet").
    """
    stacked = copy.copy(caches[0])
    stacked.layers = [copy.copy(layer) for layer in caches[0].layers]
    for i, layer in enumerate(stacked.layers):
        parts = [c.layers[i] for c in caches]
        if not isinstance(layer, SieveLayer):
            layer.keys = torch.cat([p.keys for p in parts])
            layer.values = torch.cat([p.values for p in parts])
            continue
        stores = [_as_store(p) for p in parts]
        if keep_scores:
            for j, store in enumerate(stores):
                if store.scores is None:  # a copy: the caller's store is left as it was
                    stores[j] = copy.copy(store)
                    stores[j].scores = torch.full_like(store.positions, math.nan, dtype=torch.float32)
        store = RaggedStore.concat(stores)
        store.attention = None
        if not keep_scores:
            store.scores = None
        layer.__dict__.update(_keys=None, _values=None, _positions=None, _valid=None, _attention=None, _scores=None)
        layer.store = store
        layer.recent_queries = layer.query_stats = layer.hidden_states = None
        layer.track_attention = False
        layer.budget = None  # a row's own, not the batch's
    return stacked


def clone_cache(cache: DynamicCache) -> DynamicCache:
    """A cache that can be pruned or extended without touching ``cache``.

    Pruning and a dense layer's appends make new tensors, so those are shared; a stored layer's buffer is
    shared until either cache writes to it (then that one copies it first); the attention accumulator of a
    dense layer, which the attention function adds to in place, is copied.
    """
    clone = copy.copy(cache)
    clone.layers = [copy.copy(layer) for layer in cache.layers]
    for original, layer in zip(cache.layers, clone.layers):
        if not isinstance(layer, SieveLayer):
            continue
        if layer.store is not None:
            layer.store = original.store.clone_shared()
        elif layer.__dict__.get("_attention") is not None:
            layer.__dict__["_attention"] = layer.__dict__["_attention"].clone()
    return clone
