"""Recall: compress once, and when a question arrives bring back the evicted entries it looks for.

A query-agnostic policy cannot know which of many alike lines a later question will name (RULER's multikey_3: the
"capacity cliff" near 8x). Methods that survive it keep every entry somewhere and choose once the question is known:
Quest (page digests, arXiv 2406.10774), ArkVale (pages backed up to host memory and recalled, NeurIPS 2024),
ShadowKV (low-rank keys resident, arXiv 2410.21465), SpeCache (a low-bit copy resident, arXiv 2503.16163).

Here a prompt read once (``PromptRead.tiered``, or ``attach``'s first forward) is split into two tiers by a policy
(:meth:`TieredContext.split`): the **hot** tier is the pruned cache (what attention reads and budgets count) and the
**cold** tier (:mod:`kvsieve.engine.cold`) holds every entry the policy evicted. A question is read on a copy of the
hot tier armed for recall (:meth:`TieredContext.question_cache`): in each layer, before its attention, the question's
own queries of that layer score the layer's cold entries (exactly on the cold keys, or on a small **sketch** kept hot:
1-bit key signs with a scale, or a rank-r key projection), entries are ranked by spans, not one by one (aligned
chunks by their best entry, or each entry by the best one shortly before it: a uuid spans 20-30 tokens and per-token
top-k keeps its most-attended pieces), optionally with a layer's heads ranking together, and the best ``fraction`` of
the context per KV head goes back into the hot copy at its original positions, ahead of the question's tokens.
Once per question: the copy is dropped with the answer, and the compressed context (hot and cold) is bit for bit
what it was, ready for the next question (KVzip's premise: compress once, reuse across queries).

How a question recalls (:class:`~kvsieve.recall.Recall`: the fraction, chunk, sketch and cold format) is a point's
setting, parsed at floor 0; the budget holds the sketches and the recalled entries too: at a point keeping
``1 - ratio`` of the cache, the policy keeps ``1 - ratio - fraction`` less the sketches' share
(:meth:`~kvsieve.recall.Recall.policy_ratio`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.cache import SieveLayer, cache_bytes, clone_cache, sieve_layers
from kvsieve.engine.cold import ColdLayer
from kvsieve.engine.compress import CompressionReport
from kvsieve.engine.prune import prune_prompt
from kvsieve.engine.reconstruct import Reconstruction
from kvsieve.policy import Policy
from kvsieve.recall import Recall
from kvsieve.selection import Budget

__all__ = ["KeySketch", "LayerRecall", "TieredContext"]


@dataclass
class KeySketch:
    """A layer's cold keys in small: ``sign`` (signs packed 8 a byte and each entry's mean |k|, float16: the scaled
    1-bit code with the least squared error) or ``lowrank`` (each head's top-``rank`` right singular vectors of its
    cold keys and every entry's float16 coefficients on them)."""

    kind: str
    codes: torch.Tensor  # sign: (b, h, e, d/8) uint8; lowrank: (b, h, e, r) float16
    scale: torch.Tensor  # sign: (b, h, e) float16; lowrank: (b, h, d, r) float16 basis

    @classmethod
    def of(cls, keys: torch.Tensor, valid: torch.Tensor, kind: str, rank: int = 8) -> KeySketch:
        keys = keys.float().masked_fill(~valid[..., None], 0.0)
        if kind == "sign":
            if keys.shape[-1] % 8:
                raise ValueError(f"the sign sketch packs 8 channels a byte: head dim {keys.shape[-1]} is not a "
                                 "multiple of 8 (use sketch='lowrank' or 'exact')")
            bits = (keys > 0).to(torch.uint8).reshape(*keys.shape[:-1], -1, 8)
            weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=keys.device)
            return cls(kind, (bits * weights).sum(-1).to(torch.uint8), keys.abs().mean(-1).half())
        rank = min(rank, keys.shape[-1], max(keys.shape[2], 1))
        _, _, vh = torch.linalg.svd(keys, full_matrices=False)  # (b, h, min(e, d), d)
        basis = vh[..., :rank, :].transpose(-1, -2)  # (b, h, d, r)
        return cls(kind, (keys @ basis).half(), basis.half())

    def dot(self, queries: torch.Tensor) -> torch.Tensor:
        """(b, h, e) the largest estimated q . k over ``queries`` (b, h, n, d) for every entry."""
        q = queries.float()
        if self.kind == "sign":
            shifts = torch.arange(8, dtype=torch.uint8, device=self.codes.device)
            signs = ((self.codes[..., None] >> shifts) & 1).reshape(*self.codes.shape[:-1], -1).float() * 2 - 1
            return (q @ signs.transpose(-1, -2)).amax(-2) * self.scale.float()
        return ((q @ self.scale.float()) @ self.codes.float().transpose(-1, -2)).amax(-2)

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()


@dataclass
class LayerRecall:
    """Armed on one layer of a question's copy of the hot tier; the attention function calls it once, with the
    layer's queries of the question, before its attention (``SieveLayer.recall``)."""

    cold: ColdLayer
    sketch: KeySketch | None
    tokens: int  # entries per (row, KV head) to bring back
    chunk: int
    pool: str = "chunk"
    heads: str = "own"
    recalled: int = 0  # entries brought back (all rows and heads)
    moved_bytes: int = 0

    def scores(self, queries: torch.Tensor) -> torch.Tensor:
        """(b, h, e): each cold entry's best q . k over the question's queries of its KV head's group."""
        b, hq, m, d = queries.shape
        h = self.cold.positions.shape[1]
        grouped = queries.reshape(b, h, (hq // h) * m, d)
        if self.sketch is not None:
            return self.sketch.dot(grouped)
        return (grouped.float() @ self.cold.keys().float().transpose(-1, -2)).amax(-2)

    def pooled(self, scores: torch.Tensor) -> torch.Tensor:
        """(b, h, e) each cold entry's ranking score: its chunk's best (``chunk``), or the best from ``chunk``
        positions before it to ``chunk // 4`` after (``span``), over every cold entry of its head."""
        cold, width = self.cold, self.chunk
        if self.pool == "chunk":
            chunk_of = torch.div(cold.positions, width, rounding_mode="floor")
            best = torch.full((*scores.shape[:2], int(chunk_of.max()) + 1), float("-inf"), device=scores.device)
            return best.scatter_reduce(2, chunk_of, scores, "amax").gather(2, chunk_of)
        b, h, _ = scores.shape
        after = width // 4
        dense = torch.full((b, h, int(cold.positions.max()) + 1), float("-inf"), device=scores.device)
        dense = dense.scatter_reduce(2, cold.positions, scores, "amax")  # by position; gaps stay -inf
        padded = torch.nn.functional.pad(dense.reshape(b * h, 1, -1), (width, after), value=float("-inf"))
        best = torch.nn.functional.max_pool1d(padded, width + after + 1, stride=1).reshape(b, h, -1)
        return best.gather(2, cold.positions)

    def chosen(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, h, k) indices into the cold entries and which are real: the best by :meth:`pooled`, in order."""
        cold = self.cold
        scores = self.scores(queries).masked_fill(~cold.valid, float("-inf"))
        pooled = self.pooled(scores).masked_fill(~cold.valid, float("-inf"))
        if self.heads == "shared":  # each position's best over the layer's heads, wherever it is cold
            b, h, _ = pooled.shape
            at = torch.full((b, h, int(cold.positions.max()) + 1), float("-inf"), device=pooled.device)
            at = at.scatter_reduce(2, cold.positions, pooled, "amax").amax(1, keepdim=True).expand(b, h, -1)
            pooled = at.gather(2, cold.positions).masked_fill(~cold.valid, float("-inf"))
        k = min(self.tokens, scores.shape[-1])
        order = torch.sort(pooled, dim=-1, descending=True, stable=True).indices[..., :k]  # ties: earlier first
        index = order.sort(-1).values  # back in position order
        return index, cold.valid.gather(2, index)

    def __call__(self, layer: SieveLayer, queries: torch.Tensor) -> None:
        if self.tokens <= 0 or self.cold.positions.shape[-1] == 0:
            return
        index, valid = self.chosen(queries)
        keys, values = self.cold.keys(index).to(layer.keys.dtype), self.cold.values(index).to(layer.keys.dtype)
        layer.insert_before_tail(queries.shape[2], keys, values, self.cold.positions.gather(2, index), valid)
        self.recalled = int(valid.sum())
        self.moved_bytes = self.recalled * self.cold.entry_nbytes()


@dataclass
class TieredContext:
    """A compressed context in two tiers: ``hot`` (the pruned cache, never modified here), ``cold`` (per cache layer,
    the evicted entries) and the hot ``sketches``, recalled from per question by ``recall``."""

    hot: DynamicCache
    cold: dict[int, ColdLayer]
    sketches: dict[int, KeySketch]
    recall: Recall
    context_length: int
    report: CompressionReport | None = None
    armed: list[LayerRecall] = field(default_factory=list)  # the last question's recalls

    @classmethod
    def split(cls, model, cache: DynamicCache, ids: torch.Tensor, policy: Policy, ratio: float, recall: Recall,
              protected_tail: int = 0, reconstruction: Reconstruction | None = None,
              cold_folder: str | Path | None = None) -> TieredContext:
        """Prune a copy of ``cache`` (``ids`` read whole; left as it is) at the point ``ratio`` less the recall's share
        (:meth:`~kvsieve.recall.Recall.policy_ratio`), keeping what the policy evicts in the cold tier
        (``cold_folder``: where a ``disk`` tier's files go; ``reconstruction``: KVzip's, computed on ``cache``)."""
        layers = sieve_layers(cache)
        first = layers[0][1]
        head_dim, itemsize = first.keys.shape[-1], first.keys.element_size()
        policy_ratio = recall.policy_ratio(ratio, head_dim, itemsize)
        hot, report = clone_cache(cache), None
        if policy.evicts and policy_ratio > 0:
            report = prune_prompt(model, hot, ids, policy, Budget(ratio=policy_ratio), protected_tail,
                                  reconstruction=reconstruction)
        cold, sketches = {}, {}
        for (idx, full), (_, kept) in zip(layers, sieve_layers(hot), strict=True):
            keys, values, positions, valid = _evicted(full, kept)
            cold[idx] = ColdLayer.from_entries(keys, values, positions, valid, recall.cold, cold_folder)
            if recall.sketch != "exact":
                sketches[idx] = KeySketch.of(keys, valid, recall.sketch, recall.rank)
        return cls(hot, cold, sketches, recall, ids.shape[1] - protected_tail, report)

    @property
    def recall_tokens(self) -> int:
        """Entries a question brings back per (row, KV head)."""
        return int(round(self.recall.fraction * self.context_length))

    def question_cache(self) -> DynamicCache:
        """A copy of the hot tier armed to recall on the next forward (the question's, read under ``attach``)."""
        cache = clone_cache(self.hot)
        self.armed = []
        for idx, layer in sieve_layers(cache):
            armed = LayerRecall(self.cold[idx], self.sketches.get(idx), self.recall_tokens, self.recall.chunk,
                                self.recall.pool, self.recall.heads)
            layer.recall = armed
            self.armed.append(armed)
        return cache

    # -- what it costs --------------------------------------------------------------------------------------------
    def hot_nbytes(self) -> int:
        """The hot tier: the pruned cache and the sketches."""
        return cache_bytes(self.hot) + sum(s.nbytes() for s in self.sketches.values())

    def cold_nbytes(self) -> int:
        return sum(c.nbytes() for c in self.cold.values())

    def cold_resident_nbytes(self) -> int:
        return sum(c.resident_nbytes() for c in self.cold.values())

    @property
    def moved_bytes(self) -> int:
        """Bytes the last question brought from the cold tier."""
        return sum(a.moved_bytes for a in self.armed)

    @property
    def recalled(self) -> int:
        return sum(a.recalled for a in self.armed)


def _evicted(full: SieveLayer, kept: SieveLayer) -> tuple[torch.Tensor, ...]:
    """The entries of ``full`` (a layer read whole: entry i at position i) that ``kept`` no longer holds, per
    (row, head), sorted by position and padded: (keys, values, positions, valid)."""
    b, h, n = full.positions.shape
    held = torch.zeros(b, h, n, dtype=torch.long, device=full.positions.device)
    positions, valid = kept.positions, kept.valid
    held.scatter_add_(2, positions, torch.ones_like(positions) if valid is None else valid.long())
    evicted = held == 0
    count = evicted.sum(-1)
    width = int(count.max()) if count.numel() else 0
    at = torch.arange(n, device=evicted.device)
    order = ((~evicted).long() * n + at).argsort(-1)[..., :width]  # evicted first, by position

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.gather(2, order[..., None].expand(-1, -1, -1, t.shape[-1]))

    return take(full.keys), take(full.values), full.positions.gather(2, order), \
        torch.arange(width, device=count.device)[None, None, :] < count[..., None]
