"""KVzap's network: per layer, a map from what one cache position holds to the log of KVzip's score of each KV
head there (Jegou et al., NVIDIA kvpress, arXiv:2601.07891), its inputs, and its checkpoint file.

Inputs (:data:`INPUTS`): ``"kv"``, every KV head's pre-RoPE key and value at the position (the cached keys rotated
back, :func:`pre_rope_keys`), or ``"hidden"``, the hidden state entering the layer (KVzap's own). The policy that
reads it is :class:`kvsieve.policies.kvzap.KVzap`; its training is :mod:`kvsieve.learn.kvzap_train`.

The paper's signals (issue 51's REINFORCE): a network with ``signals = S > 0`` also reads, per KV head and entry,
the first ``S`` of DistillCache's features (:data:`SIGNAL_FEATURES`, :mod:`kvsieve.networks.keep_features`: the
observation window's attention, norms, position), through a per-layer, per-head linear map added to the output.
:func:`with_signals` adds that map with zero weights to a fitted surrogate, so it scores exactly as before until
REINFORCE moves it.

A checkpoint (one safetensors file, metadata key ``kvsieve_kvzap``) holds both variants, ``linear`` and ``mlp``,
the per-layer input standardisation, the rotary frequencies, the header length, the held-out losses and the model
it was trained for (:class:`~kvsieve.networks.model_shape.ModelShape`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from kvsieve.files import save_safetensors
from kvsieve.networks.checkpoint import read_checkpoint_file, tensor_digest
from kvsieve.networks.keep_features import FEATURES, NUM_FLOAT_FEATURES
from kvsieve.networks.shipped import HOW_TO_TRAIN
from kvsieve.signals import Signals

__all__ = ["VARIANTS", "INPUTS", "SIGNAL_FEATURES", "KVzapNetConfig", "KVzapNet", "rotary_tables", "pre_rope_keys",
           "shared_positions", "kvzap_inputs", "with_signals", "save_kvzap", "load_kvzap"]

VARIANTS = ("mlp", "linear")
INPUTS = ("kv", "hidden")  # what the network reads per position: pre-RoPE keys and values, or the hidden state
SIGNAL_FEATURES = FEATURES[:NUM_FLOAT_FEATURES]  # what ``signals = S`` reads: the first S of these, per head
METADATA_KEY = "kvsieve_kvzap"
FORMAT = 1


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos t, sin t) with ``t = position * inv_freq``: (..., n) positions -> two (..., n, r/2) tables."""
    angle = positions.float()[..., None] * inv_freq.float().to(positions.device)
    return angle.cos(), angle.sin()


def pre_rope_keys(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  attention_scaling: float = 1.0,
                  tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Undo the rotary embedding: (b, h, n, d) rotated keys at (b, h, n) positions -> the keys before it.

    transformers' ``rotate_half`` convention: with ``r = 2 * len(inv_freq)`` rotated dims, halves
    ``x1 = x[:r/2]``, ``x2 = x[r/2:r]`` and ``t = position * inv_freq``, the model stores
    ``y1 = a (x1 cos t - x2 sin t)``, ``y2 = a (x2 cos t + x1 sin t)``; a rotation's inverse is its
    transpose, so ``x1 = (y1 cos t + y2 sin t) / a``, ``x2 = (y2 cos t - y1 sin t) / a``. Dims past ``r``
    are not rotated (partial rotary). ``positions`` may be (b, 1, n) when every head holds the same ones;
    ``tables`` are :func:`rotary_tables` of them, when the caller already has them (every layer shares them).
    """
    half = inv_freq.shape[-1]
    if 2 * half > keys.shape[-1]:
        raise ValueError(f"{2 * half} rotary dims do not fit keys of head dim {keys.shape[-1]}")
    cos, sin = rotary_tables(positions, inv_freq) if tables is None else tables
    y = keys.float()
    y1, y2 = y[..., :half], y[..., half: 2 * half]
    x1 = (y1 * cos + y2 * sin) / attention_scaling
    x2 = (y2 * cos - y1 * sin) / attention_scaling
    return torch.cat([x1, x2, y[..., 2 * half:]], dim=-1)


def shared_positions(signals: Signals) -> torch.Tensor:
    """(b, 1, n): the positions every KV head of the layer holds; a cache pruned per head is refused."""
    positions = signals.positions
    if signals.num_kv_heads > 1 and not bool((positions == positions[:, :1]).all()):
        raise ValueError("kvzap concatenates a layer's KV heads at each cached position, but this layer's heads hold "
                         "different positions (a cache pruned per head, e.g. decode-time eviction): only the kvzap "
                         "policy itself evicts in decode mode (the engine keeps its scores with the entries); a "
                         "program reading f.surrogate runs in prefill mode")
    return positions[:, :1]


def kvzap_inputs(signals: Signals, inv_freq: torch.Tensor | None, attention_scaling: float = 1.0,
                 tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(b, n, 2 h d) per position: every KV head's pre-RoPE key, then every head's value (float32)."""
    positions = shared_positions(signals)
    keys = signals.keys.float() if inv_freq is None else pre_rope_keys(signals.keys, positions, inv_freq,
                                                                        attention_scaling, tables)
    b, h, n, d = keys.shape
    both = torch.cat([keys, signals.values.float()], dim=1)  # (b, 2h, n, d)
    return both.permute(0, 2, 1, 3).reshape(b, n, 2 * h * d)


@dataclass(frozen=True)
class KVzapNetConfig:
    num_layers: int
    num_kv_heads: int
    input_dim: int
    hidden: int = 64
    signals: int = 0  # how many of SIGNAL_FEATURES each head's output also reads (0: the surrogate alone)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "input_dim", "hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVzapNetConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.signals, bool) or not isinstance(self.signals, int) \
                or not 0 <= self.signals <= len(SIGNAL_FEATURES):
            raise ValueError(f"KVzapNetConfig.signals must be an int in [0, {len(SIGNAL_FEATURES)}], "
                             f"got {self.signals!r}")

    def to_dict(self) -> dict:
        out = asdict(self)
        if not self.signals:  # a surrogate alone writes the metadata it always did
            del out["signals"]
        return out


class KVzapNet(nn.Module):
    """Per layer: standardise the input, then a linear map (``linear``) and, for ``mlp``, the linear map plus a
    one-hidden-layer GELU MLP on top of it (a residual: trained after the ridge fit, it starts where the linear
    variant ends, so little data cannot leave it far worse), to ``h`` outputs.

    Parameters are stacked over layers ((L, D, H) ...), so training fits every layer at once with batched
    matmuls; the layers share nothing, so that is the same as fitting each alone.
    """

    def __init__(self, config: KVzapNetConfig) -> None:
        super().__init__()
        self.config = c = config
        L, D, H, M = c.num_layers, c.input_dim, c.num_kv_heads, c.hidden
        self.register_buffer("mean", torch.zeros(L, D))
        self.register_buffer("std", torch.ones(L, D))
        self.linear_weight = nn.Parameter(torch.zeros(L, D, H))
        self.linear_bias = nn.Parameter(torch.zeros(L, H))
        self.mlp_w1 = nn.Parameter(torch.randn(L, D, M) / D ** 0.5)
        self.mlp_b1 = nn.Parameter(torch.zeros(L, M))
        self.mlp_w2 = nn.Parameter(torch.randn(L, M, H) / M ** 0.5)
        self.mlp_b2 = nn.Parameter(torch.zeros(L, H))
        if c.signals:  # per layer and head: the head's own signals -> its output
            self.signal_weight = nn.Parameter(torch.zeros(L, c.signals, H))

    def standardise(self, x: torch.Tensor, layers: slice | int) -> torch.Tensor:
        return (x - self.mean[layers, None, :]) / self.std[layers, None, :] if isinstance(layers, slice) else \
            (x - self.mean[layers]) / self.std[layers]

    def forward_all(self, x: torch.Tensor, variant: str) -> torch.Tensor:
        """(L, N, D) raw inputs, one row set per layer -> (L, N, H) predicted log scores (the surrogate's fit: a
        network that reads signals is scored per layer, :meth:`forward`)."""
        if self.config.signals:
            raise ValueError("forward_all fits the surrogate alone; this network also reads signals")
        z = self.standardise(x, slice(None))
        linear = torch.baddbmm(self.linear_bias[:, None, :], z, self.linear_weight)
        if variant == "linear":
            return linear
        hidden = nn.functional.gelu(torch.baddbmm(self.mlp_b1[:, None, :], z, self.mlp_w1))
        return linear + torch.baddbmm(self.mlp_b2[:, None, :], hidden, self.mlp_w2)

    def forward(self, x: torch.Tensor, layer: int, variant: str = "mlp",
                signals: torch.Tensor | None = None) -> torch.Tensor:
        """(b, n, D) raw inputs of ``layer`` -> (b, n, H) predicted log KVzip scores; a network that reads signals
        also takes ``signals``, (b, H, n, S) features of every head's entries, and adds their per-head linear map."""
        S = self.config.signals
        if (signals is None) != (S == 0) or (signals is not None and (
                signals.shape[-1] != S or signals.shape[1] != self.config.num_kv_heads)):
            got = None if signals is None else tuple(signals.shape)
            raise ValueError(f"this kvzap network reads {S} signals per head ((b, {self.config.num_kv_heads}, n, "
                             f"{S}) features), got {got}")
        out = self.surrogate(x, layer, variant)
        if S:
            out = out + torch.einsum("bhns,sh->bnh", signals.to(out.dtype), self.signal_weight[layer])
        return out

    def surrogate(self, x: torch.Tensor, layer: int, variant: str = "mlp") -> torch.Tensor:
        """(b, n, D) raw inputs of ``layer`` -> (b, n, H): the surrogate's own log scores, before any signals."""
        if variant not in VARIANTS:
            raise ValueError(f"kvzap variant {variant!r} is not one of {', '.join(map(repr, VARIANTS))}")
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer {layer} is outside the surrogate's {self.config.num_layers} layers")
        z = self.standardise(x, layer)
        out = z @ self.linear_weight[layer] + self.linear_bias[layer]
        if variant == "mlp":
            hidden = nn.functional.gelu(z @ self.mlp_w1[layer] + self.mlp_b1[layer])
            out = out + hidden @ self.mlp_w2[layer] + self.mlp_b2[layer]
        return out

    @torch.no_grad()
    def rescale_scores(self, scale: torch.Tensor, shift: torch.Tensor) -> None:
        """Make :meth:`surrogate` score ``scale * s + shift`` per layer and head ((L, H) each), in both variants,
        by rescaling the output layer's weights and biases in place."""
        self.linear_weight.mul_(scale[:, None, :])
        self.mlp_w2.mul_(scale[:, None, :])
        self.linear_bias.mul_(scale).add_(shift)
        self.mlp_b2.mul_(scale)

    def num_parameters(self, variant: str) -> int:
        names = ("linear_weight", "linear_bias") if variant == "linear" else ("mlp_w1", "mlp_b1", "mlp_w2", "mlp_b2")
        return sum(getattr(self, n).numel() for n in names)


def with_signals(net: KVzapNet, signals: int = len(SIGNAL_FEATURES)) -> KVzapNet:
    """A copy of the surrogate ``net`` that also reads ``signals`` of :data:`SIGNAL_FEATURES` per head, with zero
    weights on them: it scores exactly as ``net`` does until training moves them."""
    if net.config.signals:
        raise ValueError(f"this kvzap network already reads {net.config.signals} signals")
    wide = KVzapNet(replace(net.config, signals=signals))
    wide.load_state_dict({**net.state_dict(), "signal_weight": wide.signal_weight.detach().clone()}, strict=True)
    return wide.to(net.linear_weight.device)


def save_kvzap(path: str | Path, net: KVzapNet, meta: dict) -> Path:
    """Write the network (weights as float16: the file stays small) and ``meta`` atomically to ``path``.

    ``meta`` must hold ``model`` (a :meth:`ModelShape.to_dict`), ``header``, ``rope`` ({"inv_freq": per
    layer list or None, "attention_scaling": per layer}) and ``variant`` (the default one)."""
    for key in ("model", "header", "rope", "variant"):
        if key not in meta:
            raise ValueError(f"kvzap checkpoint metadata needs {key!r}")
    tensors = {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in net.state_dict().items()}
    meta = dict(meta, format=FORMAT, net=net.config.to_dict(), sha256=tensor_digest(tensors))
    if net.config.signals:  # by name: a later reordering of the features cannot silently feed it others
        meta["signal_features"] = list(SIGNAL_FEATURES[: net.config.signals])
    return save_safetensors(tensors, path, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})


def load_kvzap(path: str | Path) -> tuple[KVzapNet, dict]:
    """(network in float32, metadata) of a kvzap checkpoint; every problem is a ValueError naming the file."""
    meta, tensors = read_checkpoint_file(path, METADATA_KEY, FORMAT, "kvzap", HOW_TO_TRAIN["kvzap"])
    net = KVzapNet(KVzapNetConfig(**meta["net"]))
    wanted = meta.get("signal_features", [])
    if wanted != list(SIGNAL_FEATURES[: net.config.signals]):
        raise ValueError(f"kvzap checkpoint {str(path)!r} reads the signals {wanted}, this kvsieve computes "
                         f"{list(SIGNAL_FEATURES[: net.config.signals])}")
    try:
        net.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    except RuntimeError as err:
        raise ValueError(f"kvzap checkpoint {str(path)!r} does not hold the network its metadata describes: "
                         f"{err}") from err
    return net.eval(), meta
