"""Apply a policy to a cache: Signals per layer -> scores -> Selection -> physical gather."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.cache import SieveLayer, sieve_layers
from kvsieve.policy import Policy
from kvsieve.selection import Budget, check_allocation
from kvsieve.signals import Signals

__all__ = ["LayerReport", "CompressionReport", "layer_signals", "checked_scores", "compress_cache"]


@dataclass
class LayerReport:
    layer: int
    tokens_before: int
    tokens_after: int  # entries per head held (the widest head of a ragged layer)
    bytes_before: int
    bytes_after: int
    valid_tokens_after: float  # mean entries per head that attention can see (< tokens_after when masked)


@dataclass
class CompressionReport:
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    events: int = 0  # how many times the cache was compressed (1 in prefill mode)

    @property
    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.layers)

    @property
    def tokens_after(self) -> list[int]:
        return [r.tokens_after for r in self.layers]

    def summary(self) -> str:
        if not self.layers:
            return "no compression"
        before, after = self.bytes_before, self.bytes_after
        return (
            f"cache {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB "
            f"({100 * (1 - after / max(before, 1)):.1f}% saved), "
            f"tokens per layer {self.layers[0].tokens_before} -> {min(self.tokens_after)}..{max(self.tokens_after)}, "
            f"{1000 * self.seconds:.1f} ms"
        )


def layer_signals(
    layer: SieveLayer, layer_idx: int, num_layers: int, protected_tail: int = 0, window: int | None = None
) -> Signals:
    """Signals of one layer; ``window`` narrows the captured queries to the policy's own window."""
    if layer.recent_queries is None:
        raise RuntimeError(f"layer {layer_idx} has no captured queries: run the model under kvsieve.attach()")
    queries = layer.recent_queries if window is None else layer.recent_queries[..., -window:, :]
    return Signals(
        keys=layer.keys,
        values=layer.values,
        window_queries=queries,
        positions=layer.positions,
        layer_idx=layer_idx,
        num_layers=num_layers,
        scaling=layer.scaling,
        attention_received=layer.attention_received,
        protected_tail=protected_tail,
        query_stats=layer.query_stats,
        rope_inv_freq=None if layer.rope is None else layer.rope[0],
        rope_attention_scaling=1.0 if layer.rope is None else layer.rope[1],
        next_position=layer.seen,
        hidden_states=_aligned_hidden_states(layer),
        entry_scores=layer.entry_scores,
    )


def _aligned_hidden_states(layer: SieveLayer) -> torch.Tensor | None:
    """The layer's kept hidden states when they are one row per cached entry, in order (nothing pruned)."""
    hidden = layer.hidden_states
    if hidden is None or layer.is_ragged or hidden.shape[1] != layer.physical_length or hidden.shape[1] != layer.seen:
        return None
    return hidden


def checked_scores(policy: Policy, signals: Signals, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``policy.score(signals)`` as float, refused unless shaped (batch, kv_heads, seq) and free of NaN and -inf
    on the entries that may be kept (``valid``; padding is the engine's own). Every policy's scores pass here:
    selection would read NaN and -inf as "never keep", so a policy scoring NaN everywhere would keep its protected
    entries alone and still look like a working policy. ``+inf`` stays allowed: "keep first" (ExpectedAttention
    and KVzip protect entries with it)."""
    scores = policy.score(signals)
    expected = (signals.batch_size, signals.num_kv_heads, signals.seq_len)
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"policy {policy.name!r} returned scores of shape {shape}, expected {expected}")
    if not scores.is_floating_point():
        return scores.float()
    bad = torch.isnan(scores) | (scores == float("-inf"))
    if valid is not None:
        bad &= valid
    if bool(bad.any()):
        nan = int(torch.isnan(scores).logical_and(bad).sum())
        raise ValueError(f"policy {policy.name!r} scored {nan} entries NaN and {int(bad.sum()) - nan} -inf in layer "
                         f"{signals.layer_idx}; scores must be finite, or +inf for an entry kept first")
    return scores.float()


def layer_occupancy(layer: SieveLayer) -> float:
    """Entries per head attention can see: the physical length, or the mean valid count under masks."""
    if layer.store is not None:
        return float(layer.store.lengths.float().mean())
    if layer.valid is None:
        return float(layer.physical_length)
    return float(layer.valid.float().sum(-1).mean())


def _layer_scores(layer: SieveLayer, idx: int, num_layers: int, policy: Policy, protected_tail: int,
                  remember: bool = False) -> torch.Tensor:
    """The policy's scores of one layer; a ragged layer is made dense first (padded after its sinks, so
    the sinks and the most recent entries of every head sit where ``Selection.protected_mask`` looks).
    ``remember``: keep the scores with the entries (``SieveLayer.entry_scores``, for ``intrinsic_scores``)."""
    layer.densify(pad_at=policy.selection.sink)
    signals = layer_signals(layer, idx, num_layers, protected_tail, policy.window)
    scores = checked_scores(policy, signals, layer.valid)  # an intrinsic policy must score what entry_scores marks NaN
    if remember:
        layer.entry_scores = scores
    if layer.valid is not None:
        scores = scores.masked_fill(~layer.valid, float("-inf"))
    return scores


@torch.no_grad()
def compress_cache(
    cache: DynamicCache,
    policy: Policy,
    budget: Budget | None = None,
    protected_tail: int = 0,
    report: CompressionReport | None = None,
    layer_budgets: list[int] | None = None,
    remember_scores: bool = False,
) -> CompressionReport:
    """Prune every full-attention layer of ``cache`` in place to the policy's choice.

    Prefill mode (``budget``): the budget applies to the entries before the protected tail (the
    context) and is spread over layers by the policy's selection; the tail (the question in
    question-aware mode) is kept on top of it. ``Selection.allocation`` moves it between the heads
    of a layer (``"layer"``) or between all layers and heads (``"global"``); the total is exactly
    the budget, and heads left at different lengths are stored ragged.

    Decode mode (``layer_budgets``, one absolute budget per cache layer): a layer is pruned only when
    it holds more than its budget, and the ``protected_tail`` (the latest chunk) is kept *within* it.
    ``"global"`` acts as ``"layer"`` here, so every layer stays within its own bound.
    Masked entries (padding) count as gone and are never picked again.

    A policy with ``intrinsic_scores`` keeps its scores with the entries in decode mode; ``remember_scores``
    keeps them after a prefill compression too (a server that evicts the same cache again during decoding).
    """
    if (budget is None) == (layer_budgets is None):
        raise ValueError("give exactly one of budget (prefill mode) or layer_budgets (decode mode)")
    check_allocation(policy, policy.selection)
    report = report if report is not None else CompressionReport()
    layers = sieve_layers(cache)
    _synchronize(layers)  # on a GPU the prefill's kernels may still be queued: they are not compression
    start = time.perf_counter()
    num_layers = len(cache.layers)
    prefill = budget is not None
    if prefill and layers:
        context = layers[0][1].physical_length - protected_tail
        kept = budget.resolve(context)
        if kept < context:  # ratio 0 keeps everything, whatever the layer schedule
            layer_budgets = [b + protected_tail for b in policy.selection.layer_budgets_for(kept, context, num_layers)]
        else:
            layer_budgets = [context + protected_tail] * num_layers
    before = {idx: (layer.physical_length, layer.nbytes()) for idx, layer in layers}
    over = [(idx, layer) for idx, layer in layers if layer_occupancy(layer) > layer_budgets[idx]]
    selection = policy.selection
    remember = policy.intrinsic_scores and (remember_scores or not prefill)  # evicted again and again
    if over and prefill and selection.allocation == "global":
        scores = [_layer_scores(layer, idx, num_layers, policy, protected_tail, remember) for idx, layer in over]
        picked = selection.allocate(scores, [layer_budgets[idx] for idx, _ in over], protected_tail)
        for (_, layer), (indices, valid) in zip(over, picked):
            layer.prune(indices, valid, pad_at=selection.sink)
    else:
        for idx, layer in over:
            scores = _layer_scores(layer, idx, num_layers, policy, protected_tail, remember)
            if selection.allocation == "uniform":
                indices, valid = selection.kept_indices(scores, layer_budgets[idx], protected_tail)
            else:
                indices, valid = selection.allocate([scores], [layer_budgets[idx]], protected_tail)[0]
            layer.prune(indices, valid, pad_at=selection.sink)
    for idx, layer in layers:
        n, nbytes = before[idx]
        report.layers.append(LayerReport(idx, n, layer.physical_length, nbytes, layer.nbytes(), layer_occupancy(layer)))
    _synchronize(layers)
    report.seconds += time.perf_counter() - start
    report.events += 1
    return report


def _synchronize(layers: list[tuple[int, SieveLayer]]) -> None:
    """Wait for the device of the cache's tensors (CUDA runs kernels asynchronously; a timer must not)."""
    if layers and layers[0][1].physical_length and layers[0][1].device.type == "cuda":
        torch.cuda.synchronize(layers[0][1].device)
