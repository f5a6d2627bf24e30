"""A supervised start for the signal map of the KVzip surrogate: regression on the attention the continuation pays.

REINFORCE moves the per-head map from DistillCache's signals to the surrogate's output slowly: one step's gradient is
mostly noise, and in 120 steps of the Qwen run the map's weights stayed near 0.015 beside log scores that spread over
several units (docs/results.md, issue 51). Every method that holds most of the full cache at small budgets is
supervised first (ForesightKV runs its RL only after a supervised ranking; KVzip scores an entry by the largest
attention the context's reconstruction pays it, arXiv:2505.23416). So before REINFORCE the map is fitted
by least squares, per layer and KV head, to what the surrogate misses of the *continuation's* attention:

    target = log(exp(s) + a),   residual = target - s,   residual ~ signals @ w

with ``s`` the surrogate's predicted log KVzip score of an entry and ``a`` the largest attention any query head of
the KV head's group pays the entry from any continuation token (the question and the reference answer, read on the
full cache). ``exp(s)`` is the surrogate's estimate of the reconstruction's largest attention, so the target is the
log of the largest attention from the reconstruction *or* the continuation: an entry nobody but the question reads
(a needle) gets a high residual, one the surrogate already ranks high little. Ridge regularised; the chat header
(always kept) is left out. The fitted map is REINFORCE's warm start and its trust region's reference.

Two refinements (issue 51; chosen on the stopping rule's held-out requests, docs/results.md): the continuation's
attention weighted by ``continuation_weight`` (lambda) in the target, ``log(exp(s) + lambda a)``: the question's reads
decide the answer, the reconstruction's only approximate them; and, with ``affine``, two more columns per head, ``s``
and 1, so the fit also rescales and shifts each head's surrogate score (``(1 + c) s + b``): under one global top-k
that moves budget between heads and layers. The rescaling is folded into the surrogate's output layer (its
``linear`` and ``mlp`` output weights and biases, per head), so the network keeps its form.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.compress import compress_cache, layer_signals
from kvsieve.engine.reader import Capture, read_prompt
from kvsieve.learn.kvzap_rollout import KVzapRolloutPolicy
from kvsieve.learn.rollout import Episode, context_cache_for
from kvsieve.networks.kvzap_net import KVzapNet
from kvsieve.selection import Budget

__all__ = ["SignalFit", "SignalRows", "continuation_attention", "collect_rows", "fit_rows", "fit_signal_map"]


@dataclass(frozen=True)
class SignalFit:
    """What the fit did: rows per layer and head, the residual's variance explained (R^2) per layer, mean |w| of
    the signals' map, and the two refinements' settings."""

    rows: int
    r2_by_layer: list[float]
    mean_abs_weight: float
    continuation_weight: float = 1.0
    affine: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def continuation_attention(model, episode: Episode) -> list[torch.Tensor]:
    """Per layer, (b, kv_heads, n) the largest attention any query head of a KV head's group pays each of the ``n``
    context entries from any continuation token, on the full cache of context + continuation."""
    n, m = episode.context.shape[1], episode.continuation.shape[1]
    cache = read_prompt(model, episode.ids, Capture(window=m)).cache  # the window: the continuation's queries
    layers = sieve_layers(cache)
    out = []
    for idx, layer in layers:
        signals = layer_signals(layer, idx, len(cache.layers), 0, m)
        attention = signals.window_attention[..., :n]  # (b, h*g, m, n)
        b, h, g = attention.shape[0], signals.num_kv_heads, signals.num_groups
        out.append(attention.reshape(b, h, g * m, n).amax(dim=2))
    return out


def _episode_rows(net: KVzapNet, meta: dict, model, episode: Episode):
    """Per layer of one episode: ``(layer, s, x, a)``, the surrogate's own log scores (H, n'), the signals
    (H, n', S) and the continuation's attention (H, n'), in float64, batch rows joined, the header's rows left out."""
    header, variant = int(meta["header"]), meta["variant"]
    recorder = KVzapRolloutPolicy(net, meta, 1.0, None, record=True)
    cache = context_cache_for(model, episode, int(meta["window"]), recorder.needs_hidden_states)
    compress_cache(cache, recorder, Budget(ratio=0.5))  # scores every layer once; records its inputs
    (decision,) = recorder.decisions
    future = continuation_attention(model, episode)

    def rows(t: torch.Tensor) -> torch.Tensor:  # (b, H, n, ...) -> (H, b * n', ...)
        return t[:, :, header:].double().transpose(0, 1).flatten(1, 2)

    for layer, (inputs, signals) in decision.features:
        yield layer, rows(net.surrogate(inputs, layer, variant).transpose(1, 2)), rows(signals), rows(future[layer])


def _solve_ridge(x: torch.Tensor, y: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """(..., P) weights minimising ``mean (x @ w - y)^2 + sum_p penalty_p w_p^2``; x (..., N, P), y (..., N)."""
    xtx, xty = x.transpose(-1, -2) @ x / x.shape[-2], (x.transpose(-1, -2) @ y.unsqueeze(-1)) / x.shape[-2]
    return torch.linalg.solve(xtx + torch.diag(penalty), xty).squeeze(-1)


@dataclass(frozen=True)
class SignalRows:
    """The fit's data, per layer and head (L, H, N[, S]) in float64: the surrogate's own log scores ``s``, the
    signals ``x`` and the continuation's attention ``a`` of every context entry past the header."""

    s: torch.Tensor
    x: torch.Tensor
    a: torch.Tensor


@torch.no_grad()
def collect_rows(net: KVzapNet, meta: dict, model, episodes: list[Episode], progress: bool = False) -> SignalRows:
    """The rows of ``episodes`` (one context prefill and one full read of each); ``meta``: the checkpoint metadata
    (variant, header, ``window``)."""
    if not net.config.signals:
        raise ValueError("the signal fit needs a kvzap network that reads signals (kvzap_net.with_signals)")
    if not episodes:
        raise ValueError("the signal fit needs at least one episode")
    by_layer: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    for episode in tqdm(episodes, desc="signal fit", unit="request", disable=not progress):
        for layer, *parts in _episode_rows(net, meta, model, episode):
            by_layer.setdefault(layer, []).append(parts)
    # every layer has the same rows (one per context entry past the header)
    s, x, a = (torch.stack([torch.cat([p[i] for p in by_layer[layer]], dim=1) for layer in sorted(by_layer)])
               for i in range(3))
    return SignalRows(s, x, a)


@torch.no_grad()
def fit_signal_map(net: KVzapNet, meta: dict, model, episodes: list[Episode], ridge: float, progress: bool = False,
                   continuation_weight: float = 1.0, affine: bool = False) -> SignalFit:
    """Set ``net.signal_weight`` (in place) to the ridge fit of the module docstring over ``episodes``; with
    ``affine`` also rescale and shift each head's surrogate score, else the surrogate's own weights are untouched.
    ``meta``: the checkpoint metadata (variant, header, ``window``)."""
    _check_settings(ridge, continuation_weight)  # before the rows' minutes of work
    return fit_rows(net, collect_rows(net, meta, model, episodes, progress), ridge, continuation_weight, affine)


def _check_settings(ridge: float, continuation_weight: float) -> None:
    for name, value in (("ridge", ridge), ("continuation_weight", continuation_weight)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")


@torch.no_grad()
def fit_rows(net: KVzapNet, rows: SignalRows, ridge: float, continuation_weight: float = 1.0,
             affine: bool = False) -> SignalFit:
    """:func:`fit_signal_map` on rows already collected from ``net``'s surrogate (the same rows serve several
    settings; ``net``'s surrogate must be the one that scored them)."""
    _check_settings(ridge, continuation_weight)
    s, x, a = rows.s, rows.x, rows.a
    residual = torch.log(s.exp() + float(continuation_weight) * a) - s
    S = x.shape[-1]
    columns = torch.cat([x, s[..., None], torch.ones_like(s)[..., None]], dim=-1) if affine else x
    penalty = torch.full((columns.shape[-1],), float(ridge), dtype=torch.float64)
    if affine:
        penalty[-1] = 0.0  # the shift is not shrunk
    weight = _solve_ridge(columns, residual, penalty)  # (L, H, S [+ 2])
    predicted = torch.einsum("lhnp,lhp->lhn", columns, weight)
    # explained share of the residual's variance: 1 - SSE / SST, per layer over its heads' rows
    sse = (residual - predicted).pow(2).sum(dim=(1, 2))
    sst = (residual - residual.mean(dim=-1, keepdim=True)).pow(2).sum(dim=(1, 2))
    r2 = (1 - sse / sst.clamp_min(1e-12)).tolist()
    net.signal_weight.copy_(weight[..., :S].permute(0, 2, 1).to(net.signal_weight.dtype))
    if affine:  # s -> (1 + c) s + b, folded into the surrogate's output layer of each head
        net.rescale_scores((1 + weight[..., S]).float(), weight[..., S + 1].float())
    return SignalFit(int(s.shape[-1]), [round(v, 4) for v in r2], float(weight[..., :S].abs().mean()),
                     float(continuation_weight), affine)
