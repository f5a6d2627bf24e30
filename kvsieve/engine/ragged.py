"""One layer's keys and values as segments of one buffer: one segment per (batch row, KV head), each at its own length.

A segment holds its entries first and spare room after them, so a decode step appends every segment's new token
with one ``index_copy_`` (no copy of the layer), and the entries a prune drops are freed. Segments are grouped into
at most :data:`BUCKETS` *buckets* of equal capacity (the segments sorted by length and cut where the length jumps
most, each group as long as its longest), laid out back to back: a bucket is then a (segments, capacity, d) view
of the buffer, and attention reads it without gathering, one call per bucket, so the calls per layer never grow
with the number of heads. The price is the rounding up within a bucket (:meth:`RaggedStore.allocated_bytes`
counts it). A cache whose segments are all alike (full, uniform) is one bucket: a (b, h, capacity, d) view.

Segments are numbered row-major (``s = row * heads + head``); ``starts[s]`` is where segment ``s`` begins. The
buffer as a whole is also the layout of variable-length attention (``cu_seq_k`` = the starts in buffer order,
``seqused_k`` = the lengths). Host copies of the lengths sit beside the device copies, so no step synchronises
with the device to learn a shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BUCKETS", "Bucket", "RaggedStore", "spare_for"]

BUCKETS = 4  # capacity groups per layer and request: attention calls per layer and step (CPU), at most
_MIN_SPARE = 64  # entries of spare room a growing segment gets at least (a copy every >= 64 decode steps)


def spare_for(length: int) -> int:
    """Spare room given to a segment of ``length`` entries when it must grow: an eighth, at least 64."""
    return max(_MIN_SPARE, length // 8)


@dataclass(frozen=True)
class Bucket:
    """Segments laid out consecutively from ``base``, each with ``capacity`` entries of room."""

    base: int
    capacity: int
    segments: torch.Tensor  # (n,) int64 on the host: segment ids, in layout order
    device_segments: torch.Tensor  # the same on the buffer's device

    @property
    def count(self) -> int:
        return self.segments.numel()

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """(n, capacity, ...) view of this bucket's part of ``buffer``."""
        return buffer[self.base : self.base + self.count * self.capacity].view(self.count, self.capacity,
                                                                              *buffer.shape[1:])


def _groups(needs: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """At most :data:`BUCKETS` groups of segments, as (capacity, segment ids): the segments sorted by need (stable,
    so equal needs keep their row-major order), cut where the need jumps by the largest factors; each group as
    long as its longest need. Segments of equal need are one group."""
    order = torch.sort(needs, stable=True).indices
    sorted_needs = needs[order].double()
    jumps = sorted_needs[1:] / sorted_needs[:-1].clamp(min=1)
    cut = torch.topk(jumps, min(BUCKETS - 1, jumps.numel())) if jumps.numel() else None
    cuts = sorted(int(i) + 1 for i, jump in zip(cut.indices, cut.values) if jump > 1) if cut is not None else []
    return [(int(needs[part].max()), part) for part in torch.tensor_split(order, cuts) if part.numel()]


def _place(groups: list[tuple[int, torch.Tensor]], count: int, device) -> tuple[list[Bucket], torch.Tensor]:
    """Buckets for ``groups`` laid out one after the other, and the start of each of ``count`` segments."""
    buckets, starts, base = [], torch.zeros(count, dtype=torch.int64), 0
    for capacity, segments in groups:
        starts[segments] = base + torch.arange(segments.numel()) * capacity
        buckets.append(Bucket(base, capacity, segments, segments.to(device)))
        base += segments.numel() * capacity
    return buckets, starts


@dataclass
class RaggedStore:
    """Keys, values and per-entry fields of one layer, segment by segment (see the module docstring).

    keys, values: (T, d) the buffer; positions: (T,) int64 original positions; attention, scores: (T,) float32
    accumulated attention / remembered scores, when tracked. lengths: (S,) int64 on the host (``device_lengths``
    on the buffer's device); buckets: the layout; ``starts``: (S,) where each segment begins. ``shared``: the
    buffer is also held by a cache copy (``clone_shared``), so the next in-place write copies it first.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    rows: int
    heads: int
    lengths: torch.Tensor
    buckets: list[Bucket]
    starts: torch.Tensor
    attention: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    shared: bool = False

    def __post_init__(self) -> None:
        device = self.keys.device
        self.device_starts = self.starts.to(device, copy=True)  # copies even on the CPU: updated in place
        self.device_lengths = self.lengths.to(device, copy=True)
        self.capacity = self.capacity_in(self.buckets)
        # per bucket, its longest segment and whether all its segments are that long (read every step: kept on
        # the host, moved along by append, never recomputed from tensors)
        self.bucket_widths = [int(self.lengths[b.segments].max()) for b in self.buckets]
        self.bucket_even = [bool((self.lengths[b.segments] == width).all())
                            for b, width in zip(self.buckets, self.bucket_widths)]
        # every segment at one length and capacity, in row-major order: the buffer is a (b, h, cap, d) tensor
        # (appends keep it so: every segment grows alike)
        self.uniform = (len(self.buckets) == 1 and bool((self.lengths == self.lengths[0]).all())
                        and bool((self.buckets[0].segments == torch.arange(self.lengths.numel())).all()))

    def capacity_in(self, buckets: list[Bucket]) -> torch.Tensor:
        """(S,) each segment's room under ``buckets``."""
        capacity = torch.zeros_like(self.lengths)
        for bucket in buckets:
            capacity[bucket.segments] = bucket.capacity
        return capacity

    # -- building ------------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   valid: torch.Tensor | None = None, attention: torch.Tensor | None = None,
                   scores: torch.Tensor | None = None, spare: int | None = None) -> RaggedStore:
        """From (b, h, n, ...) tensors; ``valid`` (b, h, n) marks the entries to keep (in their order). Each
        segment gets room for its entries + ``spare`` (``None``: none, so a prune frees all it drops)."""
        b, h, n = positions.shape
        lengths = (valid.sum(-1) if valid is not None else torch.full((b, h), n, device=keys.device)).reshape(-1)
        lengths = lengths.to("cpu", torch.int64)
        buckets, starts = _place(_groups(lengths + (spare or 0)), lengths.numel(), keys.device)
        total = sum(bucket.count * bucket.capacity for bucket in buckets)
        if valid is None and not spare:  # one bucket in row-major order: the tensors are the buffer already
            flat = lambda t: None if t is None else t.reshape(b * h * n, *t.shape[3:]).contiguous()  # noqa: E731
            return cls(flat(keys), flat(values), flat(positions), b, h, lengths, buckets, starts,
                       None if attention is None else flat(attention.float()),
                       None if scores is None else flat(scores.float()))
        keep = valid if valid is not None else torch.ones(b, h, n, dtype=torch.bool, device=keys.device)
        within = torch.cumsum(keep.long(), -1) - 1  # an entry's index among its segment's kept entries
        destination = (starts.to(keys.device).view(b, h, 1) + within)[keep]

        def place(t, fill=0.0):
            if t is None:
                return None
            out = torch.full((total, *t.shape[3:]), fill, dtype=t.dtype, device=t.device)
            return out.index_copy_(0, destination, t[keep])

        return cls(place(keys), place(values), place(positions, 0), b, h, lengths, buckets, starts,
                   place(None if attention is None else attention.float()),
                   place(None if scores is None else scores.float(), math.nan))

    @classmethod
    def concat(cls, stores: list[RaggedStore]) -> RaggedStore:
        """The rows of several stores (same heads), one after the other: their buffers joined, each keeping its
        own buckets (no rounding across stores: a batch of requests holds what each of them would alone)."""
        offsets = torch.tensor([0] + [s.keys.shape[0] for s in stores[:-1]], dtype=torch.int64).cumsum(0).tolist()
        first = torch.tensor([0] + [s.lengths.numel() for s in stores[:-1]], dtype=torch.int64).cumsum(0).tolist()
        keep_attention = all(s.attention is not None for s in stores)
        keep_scores = all(s.scores is not None for s in stores)
        buckets = [Bucket(b.base + offset, b.capacity, b.segments + shift, b.device_segments + shift)
                   for s, offset, shift in zip(stores, offsets, first) for b in s.buckets]
        return cls(torch.cat([s.keys for s in stores]), torch.cat([s.values for s in stores]),
                   torch.cat([s.positions for s in stores]), sum(s.rows for s in stores), stores[0].heads,
                   torch.cat([s.lengths for s in stores]), buckets,
                   torch.cat([s.starts + offset for s, offset in zip(stores, offsets)]),
                   torch.cat([s.attention for s in stores]) if keep_attention else None,
                   torch.cat([s.scores for s in stores]) if keep_scores else None)

    def _entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(segment of each held entry, its flat index), every segment's entries in order."""
        device = self.keys.device
        lengths = self.device_lengths
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        first = torch.cumsum(lengths, 0) - lengths
        within = torch.arange(segment.numel(), device=device) - first[segment]
        return segment, self.device_starts[segment] + within

    def repacked(self, needs: torch.Tensor | None = None, segments: torch.Tensor | None = None,
                 groups: list[tuple[int, torch.Tensor]] | None = None) -> RaggedStore:
        """A new buffer holding the entries of ``segments`` (default all, in that order; numbered 0.. in the new
        store), in ``groups`` (capacity, new segment ids), or in new buckets for segments needing ``needs``."""
        if segments is None:
            segments = torch.arange(self.lengths.numel())
        lengths = self.lengths[segments]
        groups = groups if groups is not None else _groups(needs)
        chosen = RaggedStore(self.keys, self.values, self.positions, 0, self.heads, lengths, [],
                             self.starts[segments])  # the old buffer seen through the chosen segments
        segment, source = chosen._entries()
        device = self.keys.device
        buckets, starts = _place(groups, segments.numel(), device)
        if bool((chosen.capacity_in(buckets) < lengths).any()):
            raise ValueError("a segment's room is below its length")
        first = torch.cumsum(chosen.device_lengths, 0) - chosen.device_lengths
        destination = starts.to(device)[segment] + (torch.arange(segment.numel(), device=device) - first[segment])
        total = sum(bucket.count * bucket.capacity for bucket in buckets)

        def move(t, fill=0.0):
            if t is None:
                return None
            return torch.full((total, *t.shape[1:]), fill, dtype=t.dtype, device=t.device).index_copy_(
                0, destination, t[source])

        return RaggedStore(move(self.keys), move(self.values), move(self.positions, 0),
                           segments.numel() // self.heads, self.heads, lengths, buckets, starts,
                           move(self.attention), move(self.scores, math.nan))

    # -- reading -------------------------------------------------------------------------------------
    @property
    def width(self) -> int:
        """The longest segment's length."""
        return int(self.lengths.max()) if self.lengths.numel() else 0


    def head_lengths(self) -> list[int]:
        """Per KV head, the longest row's length."""
        return self.lengths.view(self.rows, self.heads).amax(0).tolist()

    def entry_bytes(self) -> int:
        """Bytes of one entry's key and value."""
        return self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()

    def nbytes(self) -> int:
        """Bytes of the entries held (every segment's own length)."""
        return int(self.lengths.sum()) * self.entry_bytes()

    def allocated_bytes(self) -> int:
        """Bytes of the key and value buffers: the entries held plus every segment's room after them."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def dense_view(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(b, h, n, d) views of the keys and values when the store is :attr:`uniform`, else None."""
        if not self.uniform:
            return None
        n = int(self.lengths[0])
        bucket = self.buckets[0]
        shape = (self.rows, self.heads, bucket.capacity, -1)
        return (bucket.view(self.keys).view(shape)[:, :, :n], bucket.view(self.values).view(shape)[:, :, :n])

    def padded_index(self, width: int, pad_at: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, h, width) flat indices of every segment padded to ``width``, and which of them are entries.

        Padding goes before entry ``pad_at`` of each segment (0: on the left, so the latest entries of every
        segment line up at the end); padding slots point at an entry of their own segment (masked)."""
        lengths = self.device_lengths[:, None]
        at = torch.arange(width, device=self.keys.device)[None, :]
        split = lengths.clamp(max=pad_at)
        pad = width - lengths
        entry = torch.where(at < split, at, at - pad)
        valid = (at < split) | (at >= split + pad)
        entry = torch.where(valid, entry, torch.zeros_like(entry)).clamp(min=0)
        index = (self.device_starts[:, None] + torch.minimum(entry, (lengths - 1).clamp(min=0)))
        index = index.clamp(max=max(self.keys.shape[0] - 1, 0))  # an empty segment at the end has no entry
        shape = (self.rows, self.heads, width)
        return index.view(shape), valid.view(shape)

    def padded(self, pad_at: int = 0, width: int | None = None) -> dict[str, torch.Tensor | None]:
        """Dense (b, h, w, ...) copies (see :meth:`padded_index`); ``valid`` is ``None`` when nothing is padding."""
        index, valid = self.padded_index(self.width if width is None else width, pad_at)
        return {"keys": self.keys[index], "values": self.values[index], "positions": self.positions[index],
                "valid": None if bool(valid.all()) else valid,
                "attention": None if self.attention is None else self.attention[index].masked_fill(~valid, 0.0),
                "scores": None if self.scores is None else self.scores[index].masked_fill(~valid, 0.0)}

    # -- writing -------------------------------------------------------------------------------------
    def writable(self, extra: int = 0, spare: int | None = None) -> RaggedStore:
        """This store, or a copy of it, that can take ``extra`` more entries per segment in place. When a
        segment must grow, every segment gets room for ``spare`` more (default :func:`spare_for` its length):
        all of them grow by one entry a step."""
        need = self.lengths + extra
        grow = bool((need > self.capacity).any())
        if not (self.shared or grow):
            return self
        if not grow:
            return self.repacked(self.capacity.clone())
        room = torch.clamp(need // 8, min=_MIN_SPARE) if spare is None else spare  # spare_for, every segment
        return self.repacked(torch.maximum(need + room, self.capacity))

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               spare: int | None = None) -> RaggedStore:
        """Append (b, h, q, ...) entries to every segment; returns the store now holding them (``self`` unless it
        had to grow, by ``spare`` beyond the need, or was shared)."""
        q = keys.shape[2]
        store = self.writable(q, spare)
        device = store.keys.device
        index = ((store.device_starts + store.device_lengths)[:, None]
                 + torch.arange(q, device=device)[None, :]).reshape(-1)
        store.keys.index_copy_(0, index, keys.reshape(-1, keys.shape[-1]))
        store.values.index_copy_(0, index, values.reshape(-1, values.shape[-1]))
        store.positions.index_copy_(0, index, positions.reshape(-1).to(store.positions.dtype))
        if store.attention is not None:
            store.attention.index_fill_(0, index, 0.0)
        if store.scores is not None:
            store.scores.index_fill_(0, index, math.nan)
        store.lengths += q
        store.device_lengths += q
        store.bucket_widths = [w + q for w in store.bucket_widths]
        return store

    def select_rows(self, rows: torch.Tensor) -> RaggedStore:
        """Only the batch rows ``rows`` (a copy; each segment keeps its bucket's capacity, so nothing is rounded)."""
        rows = rows.to("cpu", torch.int64)
        segments = (rows[:, None] * self.heads + torch.arange(self.heads)[None, :]).reshape(-1)
        renumber = torch.full((self.lengths.numel(),), -1, dtype=torch.int64)
        renumber[segments] = torch.arange(segments.numel())
        groups = [(b.capacity, renumber[b.segments][renumber[b.segments] >= 0]) for b in self.buckets]
        return self.repacked(segments=segments, groups=[(c, g) for c, g in groups if g.numel()])

    def with_room(self, tokens: int) -> RaggedStore:
        """This store, or a copy, in which every segment can take ``tokens`` more entries without growing."""
        need = self.lengths + tokens
        return self if bool((need <= self.capacity).all()) else self.repacked(torch.maximum(need, self.capacity))

    def clone_shared(self) -> RaggedStore:
        """A second handle on the same buffer; both copy it before their next in-place write."""
        self.shared = True
        return RaggedStore(self.keys, self.values, self.positions, self.rows, self.heads, self.lengths.clone(),
                           self.buckets, self.starts.clone(), self.attention, self.scores, shared=True)
