"""The context cache: a document read once and kept compressed, reused by every later question about it.

Prefix caching (vLLM's automatic prefix caching, SGLang's RadixAttention) keeps a prompt prefix's *full* KV for reuse;
a query-agnostic point can keep the prefix *compressed*, which is what KVzip's "compress once, answer any query" is
for, and with recall (``engine/tiers.py``) each question brings back the evicted entries it looks for.

An entry is one context read at one point: the compressed cache (the hot tier, or a
:class:`~kvsieve.engine.tiers.TieredContext`'s hot and cold tiers), keyed by

* its **scope**: "" (shared by every client), or a digest of the client's API key with ``--context-scope api-key``,
  so a client cannot time another's documents;
* the **point's text** (policy, ratio, mode, recall): a context read at one point is never served at another;
* the **token prefix** it holds, matched as prefix caching matches it: the longest stored context whose ids begin
  the request's context (exactly, a hash then a comparison of the ids). What follows it, the rest of the context and
  the question, is read on a copy of the entry; the entry itself is never written (``clone_cache`` copies on write).

The hot tiers count in the server's KV budget while resident (the scheduler evicts whole entries, least recently
used first, to admit a request); the cold tiers in their own budget (``--cold-budget``). Only the model thread
touches the store.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.cache import cache_allocated_bytes
from kvsieve.engine.tiers import TieredContext
from kvsieve.serve.server_metrics import Metrics

__all__ = ["CONTEXT_SCOPES", "ContextCache", "StoredContext", "scope_of"]

CONTEXT_SCOPES = ("shared", "api-key")


def scope_of(kind: str, authorization: str | None) -> str:
    """A request's scope: "" when contexts are shared, else a digest of its bearer token (never the token itself)."""
    if kind not in CONTEXT_SCOPES:
        raise ValueError(f"context scope {kind!r} is not one of {', '.join(CONTEXT_SCOPES)}")
    if kind == "shared":
        return ""
    token = (authorization or "").removeprefix("Bearer ").strip()
    return "key:" + hashlib.blake2b(token.encode(), digest_size=16).hexdigest()


def _digest(ids: torch.Tensor) -> bytes:
    return hashlib.blake2b(ids.to(torch.int64).contiguous().numpy().tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class StoredContext:
    """One context read at one point: ``hot`` (a cache holding the context's compressed entries, no room) or
    ``tiers`` (recall's two tiers), what it kept, and its bytes in each tier."""

    scope: str
    point: str
    ids: torch.Tensor  # (1, n) the context's token ids
    kept: list[int]  # entries each layer holds
    bytes_full: int  # what the context would take at full KV
    hot: DynamicCache | None = None
    tiers: TieredContext | None = None
    hot_bytes: int = field(init=False)
    cold_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if (self.hot is None) == (self.tiers is None):
            raise ValueError("a stored context holds exactly one of a compressed cache or recall's tiers")
        if self.tiers is not None:
            sketches = sum(s.nbytes() for s in self.tiers.sketches.values())
            self.hot_bytes = cache_allocated_bytes(self.tiers.hot) + sketches
            self.cold_bytes = self.tiers.cold_nbytes()
        else:
            self.hot_bytes, self.cold_bytes = cache_allocated_bytes(self.hot), 0

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @property
    def key(self) -> tuple[str, str, int, bytes]:
        return self.scope, self.point, self.length, _digest(self.ids)

    @property
    def recall_tokens(self) -> int:
        """Entries per (row, KV head) a question brings back from the cold tier."""
        return 0 if self.tiers is None else self.tiers.recall_tokens


class ContextCache:
    """Compressed contexts by (scope, point, token prefix), least recently used first out (module doc)."""

    def __init__(self, cold_budget: int, metrics: Metrics | None = None) -> None:
        if isinstance(cold_budget, bool) or not isinstance(cold_budget, int) or cold_budget < 0:
            raise ValueError(f"the cold budget must be a number of bytes >= 0, got {cold_budget!r}")
        self.cold_budget = cold_budget
        self.metrics = metrics if metrics is not None else Metrics()
        self._entries: collections.OrderedDict[tuple, StoredContext] = collections.OrderedDict()  # oldest use first
        self.hot_bytes = self.cold_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, scope: str, point: str, context_ids: torch.Tensor) -> StoredContext | None:
        """The longest stored context of ``scope`` at ``point`` whose ids begin ``context_ids``; None when there is
        none (a lookup: :meth:`used` marks the one a request is admitted on)."""
        n = context_ids.shape[1]
        lengths = sorted({e.length for e in self._entries.values()
                          if e.scope == scope and e.point == point and e.length <= n}, reverse=True)
        for length in lengths:
            entry = self._entries.get((scope, point, length, _digest(context_ids[:, :length])))
            if entry is not None and torch.equal(entry.ids, context_ids[:, :length]):
                return entry
        return None

    def used(self, entry: StoredContext | None) -> None:
        """A request was admitted on ``entry`` (a hit: it is now the most recently used) or on none (a miss)."""
        if entry is None:
            self.metrics.inc("kvsieve_context_cache_misses_total")
            return
        self._entries.move_to_end(entry.key)
        self.metrics.inc("kvsieve_context_cache_hits_total")

    def make_room(self, hot_room: int, keep: StoredContext | None = None) -> bool:
        """Evict least recently used entries (never ``keep``) until the hot tiers take at most ``hot_room`` bytes;
        False when they still do not fit."""
        for entry in list(self._entries.values()):
            if self.hot_bytes <= hot_room:
                break
            if entry is not keep:
                self._evict(entry)
        return self.hot_bytes <= hot_room

    def put(self, entry: StoredContext, hot_room: int) -> bool:
        """Store ``entry``, evicting least recently used entries until its hot tier fits ``hot_room`` bytes beside
        the others and its cold tier the cold budget; False (nothing evicted) when it alone does not fit."""
        if entry.hot_bytes > hot_room or entry.cold_bytes > self.cold_budget:
            self.metrics.inc("kvsieve_context_cache_refused_total")
            return False
        old = self._entries.get(entry.key)
        if old is not None:  # the same context read twice before either was stored: the newer one stays
            self._evict(old, counted=False)
        self.make_room(hot_room - entry.hot_bytes)
        for old in list(self._entries.values()):
            if self.cold_bytes + entry.cold_bytes <= self.cold_budget:
                break
            self._evict(old)
        self._entries[entry.key] = entry
        self.hot_bytes += entry.hot_bytes
        self.cold_bytes += entry.cold_bytes
        self._gauges()
        return True

    def _evict(self, entry: StoredContext, counted: bool = True) -> None:
        del self._entries[entry.key]
        self.hot_bytes -= entry.hot_bytes
        self.cold_bytes -= entry.cold_bytes
        if counted:
            self.metrics.inc("kvsieve_context_cache_evictions_total")
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.gauges.update(kvsieve_context_cache_entries=len(self._entries),
                                   kvsieve_context_cache_hot_bytes=self.hot_bytes,
                                   kvsieve_context_cache_cold_bytes=self.cold_bytes)
