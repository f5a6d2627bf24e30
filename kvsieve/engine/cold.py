"""The cold tier: what a policy evicted, kept off the hot cache in a compact form until a question recalls it.

The hot tier is the pruned cache attention reads at every step (what budgets count). When a prompt's read is pruned
with a cold tier, every entry the policy dropped is kept here per layer and KV head, sorted by position, in one of
:data:`~kvsieve.recall.COLD_FORMATS`:

* ``exact``: the entries as they were (on CUDA this is where pinned host memory belongs; on a CPU host and device
  memory are one, so it saves nothing and serves as the reference);
* ``int8`` / ``int4``: keys and values quantized per group of :data:`GROUP` channels, symmetric, one float16 scale a
  group (MiKV and SpeCache keep evicted entries at low precision; the grouping is the usual KIVI-style per-token one);
  int4 packs two codes a byte;
* ``disk``: the exact entries in a memory-mapped file under a folder given by the caller (nothing of it resident).

Keys are stored after RoPE, so a recalled entry goes back at its own position with no re-rotation. ``nbytes``
counts what the tier holds; ``entry_nbytes`` what one recalled entry moves.
"""

from __future__ import annotations

import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvsieve.recall import COLD_FORMATS

__all__ = ["GROUP", "ColdLayer", "dequantize", "group_size", "quantize"]
GROUP = 32  # channels per quantization group (a head's 64 or 128 channels: 2 or 4 scales an entry)


def group_size(head_dim: int) -> int:
    """:data:`GROUP`, or the whole head when its channels are not a multiple of it (tiny test models)."""
    return GROUP if head_dim % GROUP == 0 else head_dim
_LEVELS = {"int8": 127, "int4": 7}


def quantize(x: torch.Tensor, bits: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., d) -> codes (int8; int4 packed two a byte: (..., d/2) uint8) and float16 scales (..., d/group)."""
    d = x.shape[-1]
    if bits == "int4" and d % 2:
        raise ValueError(f"int4 packs two channels a byte: head dim {d} is odd")
    g = group_size(d)
    levels = _LEVELS[bits]
    groups = x.float().reshape(*x.shape[:-1], d // g, g)
    scale = groups.abs().amax(-1).clamp(min=1e-8) / levels
    scale = scale.half().float().clamp(min=torch.finfo(torch.float16).tiny)  # the scale as it is stored
    codes = torch.round(groups / scale[..., None]).clamp(-levels, levels).to(torch.int8).reshape(x.shape)
    if bits == "int4":
        nibbles = (codes + 8).to(torch.uint8)  # 1..15
        codes = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return codes, scale.half()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: str, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`quantize`, in ``dtype``."""
    if bits == "int4":
        low, high = (codes & 0xF).to(torch.int8) - 8, (codes >> 4).to(torch.int8) - 8
        codes = torch.stack([low, high], -1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    d, g = codes.shape[-1], group_size(codes.shape[-1])
    groups = codes.float().reshape(*codes.shape[:-1], d // g, g) * scale.float()[..., None]
    return groups.reshape(codes.shape).to(dtype)


@dataclass
class ColdLayer:
    """One layer's evicted entries: (b, h, e) ``positions`` sorted, ``valid`` marking real ones (heads evicted
    different counts), and the keys and values in ``format``."""

    positions: torch.Tensor
    valid: torch.Tensor
    format: str
    dtype: torch.dtype
    head_dim: int
    _keys: object = None  # a tensor, (codes, scales), or a numpy memmap
    _values: object = None
    _file: Path | None = None

    @classmethod
    def from_entries(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                     format: str = "exact", folder: str | Path | None = None) -> ColdLayer:
        """From (b, h, e, d) keys and values, (b, h, e) positions and validity."""
        if format not in COLD_FORMATS:
            raise ValueError(f"cold format {format!r} is not one of {', '.join(COLD_FORMATS)}")
        layer = cls(positions.clone(), valid.clone(), format, keys.dtype, keys.shape[-1])
        if format == "exact":
            layer._keys, layer._values = keys.clone(), values.clone()
        elif format in _LEVELS:
            layer._keys, layer._values = quantize(keys, format), quantize(values, format)
        else:
            layer._file, layer._keys, layer._values = _to_disk(keys, values, folder)
            weakref.finalize(layer, layer._file.unlink, missing_ok=True)  # the file lives as long as the layer
        return layer

    @property
    def entries(self) -> int:
        """Evicted entries held (real ones, all rows and heads)."""
        return int(self.valid.sum())

    def _part(self, stored, index: torch.Tensor | None) -> torch.Tensor:
        if self.format == "exact":
            return stored if index is None else _take(stored, index)
        if self.format == "disk":
            whole = torch.from_numpy(np.array(stored))  # read from the file (a copy)
            whole = whole.view(self.dtype) if self.dtype == torch.bfloat16 else whole
            return whole if index is None else _take(whole, index)
        codes, scale = stored
        if index is not None:
            codes, scale = _take(codes, index), _take(scale, index)
        return dequantize(codes, scale, self.format, self.dtype)

    def keys(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """(b, h, e or k, d) keys as attention reads them (dequantized; ``index`` (b, h, k): those entries)."""
        return self._part(self._keys, index)

    def values(self, index: torch.Tensor | None = None) -> torch.Tensor:
        return self._part(self._values, index)

    def entry_nbytes(self) -> int:
        """Bytes one entry (its key and value, one head) takes in this tier: what recalling it moves."""
        d, size = self.head_dim, torch.empty((), dtype=self.dtype).element_size()
        if self.format in ("exact", "disk"):
            return 2 * d * size
        per_code = 1 if self.format == "int8" else 0.5
        return int(2 * (d * per_code + (d // group_size(d)) * 2))

    def nbytes(self) -> int:
        """Bytes of the keys and values held (padding slots excluded), resident or on disk."""
        return self.entries * self.entry_nbytes()

    def resident_nbytes(self) -> int:
        """Of :meth:`nbytes`, what sits in memory (a disk tier: none)."""
        return 0 if self.format == "disk" else self.nbytes()


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t`` (b, h, e, ...) at ``index`` (b, h, k) along the entries."""
    return t.gather(2, index.reshape(*index.shape, *[1] * (t.dim() - 3)).expand(*index.shape, *t.shape[3:]))


def _to_disk(keys: torch.Tensor, values: torch.Tensor, folder: str | Path | None):
    """Both tensors into one memory-mapped file under ``folder`` (a temporary folder when None); fails loudly when
    the file cannot be written (an unwritable path, a full disk), never keeping fewer entries."""
    root = Path(folder) if folder is not None else Path(tempfile.gettempdir())
    try:
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"kvsieve-cold-{uuid.uuid4().hex}.bin"
        raw = [t.detach().cpu().contiguous() for t in (keys, values)]
        arrays = [(t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy() for t in raw]
        whole = np.memmap(path, dtype=arrays[0].dtype, mode="w+", shape=(2, *arrays[0].shape))
        whole[0], whole[1] = arrays
        whole.flush()
    except (OSError, ValueError) as err:
        raise OSError(f"the cold tier could not be written under {str(root)!r}: {err}") from err
    read = np.memmap(path, dtype=arrays[0].dtype, mode="r", shape=(2, *arrays[0].shape))
    return path, read[0], read[1]
