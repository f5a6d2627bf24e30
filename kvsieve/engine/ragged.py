"""One layer's keys and values as segments of one buffer: one segment per (batch row, KV head), each at its own length.

A segment holds its entries first and spare room after them, so a decode step appends every segment's new token
with one ``index_copy_`` (no copy of the layer), and the entries a prune drops are freed. Segments are grouped into
at most :data:`BUCKETS` *buckets* of equal capacity (the segments sorted by length and cut into groups of equal
count, each group as long as its longest), laid out back to back: a bucket is then a (segments, capacity, d) view
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

BUCKETS = 4  # capacity groups per layer: attention calls per layer and step, at most
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


def _layout(needs: torch.Tensor, device) -> tuple[list[Bucket], torch.Tensor]:
    """Buckets for segments needing ``needs`` (S,) entries of room each, and every segment's start.

    Sorted by need (stable, so equal needs keep their row-major order) and cut into groups of equal count;
    neighbouring groups of one capacity are one bucket."""
    order = torch.sort(needs, stable=True).indices
    groups = [g for g in torch.tensor_split(order, min(BUCKETS, max(1, order.numel()))) if g.numel()]
    merged: list[tuple[int, list[torch.Tensor]]] = []
    for group in groups:
        capacity = int(needs[group].max())
        if merged and merged[-1][0] == capacity:
            merged[-1][1].append(group)
        else:
            merged.append((capacity, [group]))
    buckets, starts, base = [], torch.empty_like(needs), 0
    for capacity, parts in merged:
        segments = torch.cat(parts)
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
        self.capacity = torch.empty_like(self.lengths)
        for bucket in self.buckets:
            self.capacity[bucket.segments] = bucket.capacity
        # every segment at one length and capacity, in row-major order: the buffer is a (b, h, cap, d) tensor
        # (appends keep it so: every segment grows alike)
        self.uniform = (len(self.buckets) == 1 and bool((self.lengths == self.lengths[0]).all())
                        and bool((self.buckets[0].segments == torch.arange(self.lengths.numel())).all()))

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
        buckets, starts = _layout(lengths + (spare or 0), keys.device)
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
        """The rows of several stores (same heads), one after the other (one copy into a fresh layout)."""
        offsets = torch.tensor([0] + [s.keys.shape[0] for s in stores[:-1]], dtype=torch.int64).cumsum(0).tolist()
        keep_attention = all(s.attention is not None for s in stores)
        keep_scores = all(s.scores is not None for s in stores)
        lengths = torch.cat([s.lengths for s in stores])
        starts = torch.cat([s.starts + offset for s, offset in zip(stores, offsets)])
        joined = cls(torch.cat([s.keys for s in stores]), torch.cat([s.values for s in stores]),
                     torch.cat([s.positions for s in stores]), sum(s.rows for s in stores), stores[0].heads,
                     lengths, [], starts,
                     torch.cat([s.attention for s in stores]) if keep_attention else None,
                     torch.cat([s.scores for s in stores]) if keep_scores else None)
        return joined.repacked(torch.cat([s.capacity for s in stores]))

    def _entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(segment of each held entry, its flat index), every segment's entries in order."""
        device = self.keys.device
        lengths = self.device_lengths
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        first = torch.cumsum(lengths, 0) - lengths
        within = torch.arange(segment.numel(), device=device) - first[segment]
        return segment, self.device_starts[segment] + within

    def repacked(self, needs: torch.Tensor, segments: torch.Tensor | None = None) -> RaggedStore:
        """A new buffer holding the entries of ``segments`` (default all, in that order), each with room for at
        least ``needs`` entries."""
        if segments is None:
            segments = torch.arange(self.lengths.numel())
        lengths = self.lengths[segments]
        if bool((needs < lengths).any()):
            raise ValueError("a segment's room is below its length")
        chosen = RaggedStore(self.keys, self.values, self.positions, 0, self.heads, lengths, [],
                             self.starts[segments])  # the old buffer seen through the chosen segments
        segment, source = chosen._entries()
        device = self.keys.device
        buckets, starts = _layout(needs, device)
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
        room = torch.tensor([spare_for(int(x)) for x in need]) if spare is None else spare
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
        return store

    def select_rows(self, rows: torch.Tensor) -> RaggedStore:
        """Only the batch rows ``rows`` (a copy, each segment keeping its room)."""
        rows = rows.to("cpu", torch.int64)
        segments = (rows[:, None] * self.heads + torch.arange(self.heads)[None, :]).reshape(-1)
        return self.repacked(self.capacity[segments].clone(), segments)

    def clone_shared(self) -> RaggedStore:
        """A second handle on the same buffer; both copy it before their next in-place write."""
        self.shared = True
        return RaggedStore(self.keys, self.values, self.positions, self.rows, self.heads, self.lengths.clone(),
                           self.buckets, self.starts.clone(), self.attention, self.scores, shared=True)
