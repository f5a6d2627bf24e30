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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.compress import compress_cache, layer_signals
from kvsieve.learn.kvzap_rollout import KVzapRolloutPolicy
from kvsieve.learn.rollout import Episode, context_cache_for
from kvsieve.networks.kvzap_net import KVzapNet
from kvsieve.policy import FullCache
from kvsieve.selection import Budget

__all__ = ["SignalFit", "continuation_attention", "fit_signal_map"]


@dataclass(frozen=True)
class SignalFit:
    """What the fit did: rows per layer and head, the residual's variance explained (R^2) per layer, mean |w|."""

    rows: int
    r2_by_layer: list[float]
    mean_abs_weight: float

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def continuation_attention(model, episode: Episode) -> list[torch.Tensor]:
    """Per layer, (b, kv_heads, n) the largest attention any query head of a KV head's group pays each of the ``n``
    context entries from any continuation token, on the full cache of context + continuation."""
    n, m = episode.context.shape[1], episode.continuation.shape[1]
    capture = FullCache(window=m)  # the captured window: the continuation's queries
    with attach(model, capture, ratio=0.0):
        cache = model(input_ids=episode.ids, use_cache=True, logits_to_keep=1).cache
    layers = sieve_layers(cache)
    out = []
    for idx, layer in layers:
        signals = layer_signals(layer, idx, len(cache.layers), 0, m)
        attention = signals.window_attention[..., :n]  # (b, h*g, m, n)
        b, h, g = attention.shape[0], signals.num_kv_heads, signals.num_groups
        out.append(attention.reshape(b, h, g * m, n).amax(dim=2))
    return out


def _solve_ridge(xtx: torch.Tensor, xty: torch.Tensor, rows: int, ridge: float) -> torch.Tensor:
    """(..., S) least-squares weights from summed ``X^T X`` (..., S, S) and ``X^T y`` (..., S) over ``rows`` rows,
    with ``ridge`` added to the diagonal of the per-row mean ``X^T X``."""
    eye = torch.eye(xtx.shape[-1], dtype=xtx.dtype)
    return torch.linalg.solve(xtx / rows + ridge * eye, (xty / rows).unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def fit_signal_map(net: KVzapNet, meta: dict, model, episodes: list[Episode], ridge: float,
                   progress: bool = False) -> SignalFit:
    """Set ``net.signal_weight`` (in place) to the ridge fit of the module docstring over ``episodes``; the
    surrogate's own weights are untouched. ``meta``: the checkpoint metadata (variant, header, ``window``)."""
    if not net.config.signals:
        raise ValueError("fit_signal_map needs a kvzap network that reads signals (kvzap_net.with_signals)")
    if not episodes:
        raise ValueError("fit_signal_map needs at least one episode")
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge > 0:
        raise ValueError(f"ridge must be a number > 0, got {ridge!r}")
    L, S, H = net.signal_weight.shape
    header, variant = int(meta["header"]), meta["variant"]
    xtx = torch.zeros(L, H, S, S, dtype=torch.float64)
    xty = torch.zeros(L, H, S, dtype=torch.float64)
    yy, ysum = torch.zeros(L, H, dtype=torch.float64), torch.zeros(L, H, dtype=torch.float64)
    rows = 0
    for episode in tqdm(episodes, desc="signal fit", unit="request", disable=not progress):
        recorder = KVzapRolloutPolicy(net, meta, 1.0, None, record=True)
        cache = context_cache_for(model, episode, int(meta["window"]), recorder.needs_hidden_states)
        compress_cache(cache, recorder, Budget(ratio=0.5))  # scores every layer once; records its inputs
        (decision,) = recorder.decisions
        future = continuation_attention(model, episode)
        for layer, (inputs, signals) in decision.features:
            total = net(inputs, layer, variant, signals)  # (b, n, H)
            mapped = torch.einsum("bhns,sh->bnh", signals, net.signal_weight[layer])
            surrogate = (total - mapped).transpose(1, 2).double()  # (b, H, n), the map's current part removed
            target = torch.log(surrogate.exp() + future[layer].double())
            residual = (target - surrogate)[:, :, header:]  # (b, H, n')
            x = signals[:, :, header:, :].double()  # (b, H, n', S)
            xtx[layer] += torch.einsum("bhns,bhnt->hst", x, x)
            xty[layer] += torch.einsum("bhns,bhn->hs", x, residual)
            yy[layer] += residual.pow(2).sum(dim=(0, 2))
            ysum[layer] += residual.sum(dim=(0, 2))
        rows += decision.features[0][1][0].shape[0] * (episode.context.shape[1] - header)
    weight = _solve_ridge(xtx, xty, rows, float(ridge))  # (L, H, S)
    # explained share of the residual's variance: 1 - SSE / SST, SSE = y'y - 2 w'X'y + w'X'Xw
    sse = yy - 2 * (weight * xty).sum(-1) + torch.einsum("lhs,lhst,lht->lh", weight, xtx, weight)
    sst = yy - ysum.pow(2) / rows
    r2 = (1 - sse.sum(-1) / sst.sum(-1).clamp_min(1e-12)).tolist()
    net.signal_weight.copy_(weight.permute(0, 2, 1).to(net.signal_weight.dtype))
    return SignalFit(rows, [round(v, 4) for v in r2], float(weight.abs().mean()))
