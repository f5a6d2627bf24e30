"""One layer's keys and values as segments of one buffer: one segment per (batch row, KV head), each at its own length.

A segment holds its entries first and spare capacity after them, so a decode step appends every segment's new
token with one ``index_copy_`` (no copy of the layer) and the entries dropped by a prune are freed (each
segment is only as long as its own entries plus its spare). Segments are laid out row-major (segment
``s = row * heads + head``) and back to back (``starts[s + 1] == starts[s] + capacity[s]``), which is the layout
variable-length attention reads directly (``cu_seq_k`` = the starts, ``seqused_k`` = the lengths). When every
segment has the same length and capacity (a uniform or full cache) the buffer *is* a (b, h, capacity, d)
tensor, and attention reads a view of it without gathering.

Host copies of the lengths and capacities are kept beside the device copies, so no step synchronises with the
device to learn a shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["RaggedStore", "spare_for"]

_MIN_SPARE = 64  # entries of spare capacity a growing segment gets at least (a copy every >= 64 decode steps)


def spare_for(length: int) -> int:
    """Spare capacity given to a segment of ``length`` entries when it must grow: an eighth, at least 64."""
    return max(_MIN_SPARE, length // 8)


@dataclass
class RaggedStore:
    """Keys, values and per-entry fields of one layer, segment by segment (see the module docstring).

    keys, values: (T, d) the buffer; positions: (T,) int64 original positions; attention, scores: (T,)
    float32 accumulated attention / remembered scores, when tracked. starts, capacity, lengths: (S,) int64 on
    the host; ``device_starts`` / ``device_lengths`` the same on the buffer's device. ``shared``: the buffer is
    also held by a cache copy (``clone``), so the next in-place write copies it first.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    rows: int
    heads: int
    starts: torch.Tensor
    capacity: torch.Tensor
    lengths: torch.Tensor
    attention: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    shared: bool = False

    def __post_init__(self) -> None:
        device = self.keys.device
        self.device_starts = self.starts.to(device, copy=True)  # copies even on the CPU: both are updated in place
        self.device_lengths = self.lengths.to(device, copy=True)
        caps, lengths = self.capacity, self.lengths
        self.uniform = bool(caps.numel()) and bool((caps == caps[0]).all()) and bool((lengths == lengths[0]).all())

    # -- building ------------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   valid: torch.Tensor | None = None, attention: torch.Tensor | None = None,
                   scores: torch.Tensor | None = None, spare: int | None = None) -> RaggedStore:
        """From (b, h, n, ...) tensors; ``valid`` (b, h, n) marks the entries to keep (in their order).

        Each segment gets capacity = its entries + ``spare`` (default none: the bytes are exactly the entries;
        ``None`` is not "default spare" but zero, so a prune frees everything it drops)."""
        b, h, n = positions.shape
        lengths = (valid.sum(-1) if valid is not None else torch.full((b, h), n, device=keys.device)).reshape(-1)
        lengths = lengths.to("cpu", torch.int64)
        capacity = lengths + (spare or 0)
        if valid is None and not spare:  # already back to back
            flat = lambda t: None if t is None else t.reshape(b * h * n, *t.shape[3:])  # noqa: E731
            return cls(flat(keys).contiguous(), flat(values).contiguous(), flat(positions).contiguous(), b, h,
                       torch.arange(b * h, dtype=torch.int64) * n, capacity, lengths,
                       None if attention is None else flat(attention).float().contiguous(),
                       None if scores is None else flat(scores).float().contiguous())
        keep = valid if valid is not None else torch.ones(b, h, n, dtype=torch.bool, device=keys.device)
        starts = torch.cumsum(capacity, 0) - capacity
        within = torch.cumsum(keep.long(), -1) - 1  # an entry's index among its segment's kept entries
        destination = (starts.to(keys.device).view(b, h, 1) + within)[keep]
        total = int(capacity.sum())

        def place(t, fill=0.0):
            if t is None:
                return None
            out = torch.full((total, *t.shape[3:]), fill, dtype=t.dtype, device=t.device)
            return out.index_copy_(0, destination, t[keep])

        return cls(place(keys), place(values), place(positions, 0), b, h, starts, capacity, lengths,
                   place(None if attention is None else attention.float()),
                   place(None if scores is None else scores.float(), math.nan))

    @classmethod
    def concat(cls, stores: list[RaggedStore]) -> RaggedStore:
        """The rows of several stores (same heads), one after the other."""
        offsets = torch.tensor([0] + [s.keys.shape[0] for s in stores[:-1]], dtype=torch.int64).cumsum(0)
        keep_attention = all(s.attention is not None for s in stores)
        keep_scores = all(s.scores is not None for s in stores)
        return cls(torch.cat([s.keys for s in stores]), torch.cat([s.values for s in stores]),
                   torch.cat([s.positions for s in stores]), sum(s.rows for s in stores), stores[0].heads,
                   torch.cat([s.starts + o for s, o in zip(stores, offsets.tolist())]),
                   torch.cat([s.capacity for s in stores]), torch.cat([s.lengths for s in stores]),
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

    def repacked(self, capacity: torch.Tensor, segments: torch.Tensor | None = None) -> RaggedStore:
        """A new buffer holding the entries of ``segments`` (default all) with the given capacities."""
        if segments is None:
            segments = torch.arange(self.lengths.numel())
        lengths = self.lengths[segments]
        if bool((capacity < lengths).any()):
            raise ValueError("a segment's capacity is below its length")
        chosen = RaggedStore(self.keys, self.values, self.positions, 0, self.heads, self.starts[segments],
                             capacity, lengths)  # the old buffer seen through the chosen segments
        segment, source = chosen._entries()
        starts = torch.cumsum(capacity, 0) - capacity
        first = torch.cumsum(lengths.to(self.keys.device), 0) - lengths.to(self.keys.device)
        destination = starts.to(self.keys.device)[segment] + (torch.arange(segment.numel(), device=segment.device)
                                                               - first[segment])
        total = int(capacity.sum())

        def move(t, fill=0.0):
            if t is None:
                return None
            return torch.full((total, *t.shape[1:]), fill, dtype=t.dtype, device=t.device).index_copy_(
                0, destination, t[source])

        return RaggedStore(move(self.keys), move(self.values), move(self.positions, 0), segments.numel() // self.heads,
                           self.heads, starts, capacity, lengths, move(self.attention), move(self.scores, math.nan))

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
        """Bytes of the key and value buffers: the entries held plus every segment's spare room."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def dense_view(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(b, h, n, d) views of the keys and values when every segment has one length and capacity, else None."""
        if not self.uniform:
            return None
        cap, n = int(self.capacity[0]), int(self.lengths[0])
        shape = (self.rows, self.heads, cap)
        return self.keys.view(*shape, -1)[:, :, :n], self.values.view(*shape, -1)[:, :, :n]

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
        out = {"keys": self.keys[index], "values": self.values[index], "positions": self.positions[index],
               "valid": None if bool(valid.all()) else valid,
               "attention": None if self.attention is None else self.attention[index].masked_fill(~valid, 0.0),
               "scores": None if self.scores is None else self.scores[index].masked_fill(~valid, 0.0)}
        return out

    # -- writing -------------------------------------------------------------------------------------
    def writable(self, extra: int = 0, spare: int | None = None) -> RaggedStore:
        """This store, or a copy of it, that can take ``extra`` more entries per segment in place; a segment that
        must grow gets ``spare`` more (default :func:`spare_for` its new length)."""
        need = self.lengths + extra
        if self.shared or bool((need > self.capacity).any()):
            room = torch.tensor([spare_for(int(x)) for x in need]) if spare is None else spare
            grown = torch.where(need > self.capacity, need + room, self.capacity)
            return self.repacked(grown)
        return self

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
        """Only the batch rows ``rows`` (a copy, capacities kept)."""
        rows = rows.to("cpu", torch.int64)
        segments = (rows[:, None] * self.heads + torch.arange(self.heads)[None, :]).reshape(-1)
        return self.repacked(self.capacity[segments].clone(), segments)

    def clone_shared(self) -> RaggedStore:
        """A second handle on the same buffer; both copy it before their next in-place write."""
        self.shared = True
        twin = RaggedStore(self.keys, self.values, self.positions, self.rows, self.heads, self.starts.clone(),
                           self.capacity.clone(), self.lengths.clone(), self.attention, self.scores, shared=True)
        return twin
