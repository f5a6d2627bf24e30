"""The compact policy interface evolved programs are written against.

An evolved program never sees the model, the cache or the question: it gets a :class:`Features` of
one layer, a handful of per-entry tensors derived from the context's cache and the observation
window, and returns one score per cached entry and KV head. The helpers a program calls are defined here
(``HELPERS``); what a program may call, with each operation's typed signature and cost, is the table of
``operations.py``, from which the checker, the interpreter and the grammar are read.

Shapes: ``b`` batch, ``h`` KV heads, ``g`` query heads per KV head, ``n`` cached context entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from kvsieve.files import save_safetensors
from kvsieve.signals import Signals

__all__ = ["Features", "TENSOR_FIELDS", "SCALAR_FIELDS", "HELPERS", "HELPERS_VERSION", "synthetic_features",
           "save_features", "load_features"]

TENSOR_FIELDS = ("attn", "last_attn", "key_norm", "value_norm", "position", "surrogate")
SCALAR_FIELDS = ("layer", "window", "n", "group")


@dataclass(eq=False)
class Features:
    """What an evolved scorer reads about one layer (float32 tensors, read-only by contract).

    Attributes:
        attn: (b, h, g, n) attention each entry received from the observation window's queries,
            summed over the window queries, per query head (grouped by the KV head it shares).
        last_attn: (b, h, g, n) attention from the last query of the context alone.
        key_norm, value_norm: (b, h, n) L2 norms of the cached keys and values.
        position: (n,) position of each entry scaled to [0, 1] (0 first, 1 last context token).
        surrogate: (b, h, n) the model's KVzip surrogate (kvzap): predicted log KVzip score of each entry,
            one scale for every head and layer; zeros where no surrogate ships for the model.
        layer: this layer's index scaled to [0, 1].
        window: size of the observation window; the last ``window`` entries are always kept.
        n: number of cached context entries.
        group: query heads per KV head.
    """

    attn: torch.Tensor
    last_attn: torch.Tensor
    key_norm: torch.Tensor
    value_norm: torch.Tensor
    position: torch.Tensor
    surrogate: torch.Tensor
    layer: float
    window: int
    n: int
    group: int

    @classmethod
    def from_signals(cls, signals: Signals, surrogate: torch.Tensor | None = None) -> Features:
        """The features of one layer; ``surrogate`` is the kvzap prediction for it (None: zeros)."""
        b, h, n = signals.batch_size, signals.num_kv_heads, signals.seq_len
        if surrogate is not None and tuple(surrogate.shape) != (b, h, n):
            raise ValueError(f"surrogate scores shaped {tuple(surrogate.shape)}, expected {(b, h, n)}")
        g, w = signals.num_groups, signals.window_size
        window_attention = signals.window_attention.reshape(b, h, g, w, n)
        layer = signals.layer_idx / max(signals.num_layers - 1, 1)
        return cls(
            attn=window_attention.sum(dim=3).contiguous(),
            last_attn=window_attention[:, :, :, -1].contiguous(),
            key_norm=signals.key_norms.contiguous(),
            value_norm=signals.value_norms.contiguous(),
            position=signals.relative_positions[0, 0].contiguous(),
            surrogate=torch.zeros(b, h, n) if surrogate is None else surrogate.float().contiguous(),
            layer=float(layer), window=int(w), n=int(n), group=int(g),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    def scalars(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in SCALAR_FIELDS}

    @classmethod
    def from_parts(cls, tensors: dict[str, torch.Tensor], scalars: dict) -> Features:
        missing = [f.name for f in fields(cls) if f.name not in tensors and f.name not in scalars]
        if missing:
            raise ValueError(f"features are missing {missing}")
        return cls(**{name: tensors[name] for name in TENSOR_FIELDS},
                     layer=float(scalars["layer"]), window=int(scalars["window"]), n=int(scalars["n"]),
                     group=int(scalars["group"]))

    @property
    def score_shape(self) -> tuple[int, int, int]:
        return tuple(self.key_norm.shape)


def synthetic_features(seed: int, batch: int = 1, kv_heads: int = 2, group: int = 3, n: int = 257,
                       window: int = 16, layer: float = 0.5) -> Features:
    """Random but well-formed features (softmax rows, positive norms) for the stage-1 invariants."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, kv_heads, group, window, n, generator=gen) * 2.0
    future = torch.triu(torch.ones(window, window, dtype=torch.bool), diagonal=1)
    logits[..., -window:].masked_fill_(future, float("-inf"))
    attention = torch.softmax(logits, dim=-1)
    return Features(
        attn=attention.sum(dim=3), last_attn=attention[:, :, :, -1].clone(),
        key_norm=torch.rand(batch, kv_heads, n, generator=gen) * 20 + 1,
        value_norm=torch.rand(batch, kv_heads, n, generator=gen) * 5 + 0.1,
        position=torch.arange(n, dtype=torch.float32) / max(n - 1, 1),
        surrogate=torch.randn(batch, kv_heads, n, generator=gen) * 2.0 - 6.0,  # log scores, as kvzap's
        layer=layer, window=window, n=n, group=group,
    )


def save_features(path: str | Path, features: dict[str, Features]) -> None:
    """Write named features to one safetensors file (tensors ``KEY.FIELD``, scalars in the metadata), under a
    temporary name and then renamed: a reader (a sandbox, another run sharing the folder) sees the old file or the
    new one, never half of one."""
    for key in features:
        if not key or "." in key:
            raise ValueError(f"feature key {key!r} must be non-empty and contain no '.'")
    tensors = {f"{key}.{name}": t.detach().to(torch.float32).contiguous()
               for key, feats in features.items() for name, t in feats.tensors().items()}
    meta = {key: feats.scalars() for key, feats in features.items()}
    save_safetensors(tensors, path, metadata={"scalars": json.dumps(meta)})


def load_features(path: str | Path) -> dict[str, Features]:
    """Read what :func:`save_features` wrote (safetensors: no code runs while loading)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["scalars"])
        out = {}
        for key, scalars in meta.items():
            tensors = {name: handle.get_tensor(f"{key}.{name}") for name in TENSOR_FIELDS}
            out[key] = Features.from_parts(tensors, scalars)
    return out


# --- what a candidate may call ----------------------------------------------------------------------


def pool(x: torch.Tensor, k: int) -> torch.Tensor:
    """Mean over a centred window of ``k`` (odd) entries along the last dim, zero padded, same length."""
    k = _odd_kernel(k)
    shape = x.shape
    out = F.avg_pool1d(x.reshape(-1, 1, shape[-1]), k, stride=1, padding=k // 2, count_include_pad=True)
    return out.reshape(shape)


def max_pool(x: torch.Tensor, k: int) -> torch.Tensor:
    """Max over a centred window of ``k`` (odd) entries along the last dim, same length."""
    k = _odd_kernel(k)
    shape = x.shape
    return F.max_pool1d(x.reshape(-1, 1, shape[-1]), k, stride=1, padding=k // 2).reshape(shape)


def normalize(x: torch.Tensor) -> torch.Tensor:
    """``x`` divided by its largest magnitude along the last dim (scale-free signals can be added)."""
    return x / x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)


def unit_mean(x: torch.Tensor) -> torch.Tensor:
    """``x`` divided by its mean magnitude along the last dim (signals on different scales can be added)."""
    return x / x.abs().mean(dim=-1, keepdim=True).clamp_min(1e-12)


def rank(x: torch.Tensor) -> torch.Tensor:
    """Rank of each entry along the last dim scaled to [0, 1] (ties broken by position)."""
    order = torch.argsort(torch.argsort(x, dim=-1, stable=True), dim=-1, stable=True)
    return order.to(torch.float32) / max(x.shape[-1] - 1, 1)


def group_max(x: torch.Tensor) -> torch.Tensor:
    """(b, h, g, n) -> (b, h, n): the largest over the query heads that share a KV head."""
    return x.amax(dim=2)


def group_mean(x: torch.Tensor) -> torch.Tensor:
    """(b, h, g, n) -> (b, h, n): the mean over the query heads that share a KV head."""
    return x.mean(dim=2)


def _odd_kernel(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k > 257:
        raise ValueError(f"kernel size must be an int in [1, 257], got {k!r}")
    return k if k % 2 else k + 1


# What the helpers compute; an evolution database records it, since its scores hold only for these semantics.
# 2: normalize and unit_mean divide by a magnitude (1 divided by the signed max / mean clamped at 1e-12, so a
# signal with a negative mean, such as f.surrogate's log scores, was multiplied by 1e12 and swamped the rest).
HELPERS_VERSION = 2
HELPERS = {"pool": pool, "max_pool": max_pool, "normalize": normalize, "unit_mean": unit_mean, "rank": rank,
           "group_max": group_max, "group_mean": group_mean}
