"""REINFORCE on top of the KVzip surrogate: its rollouts are one Plackett-Luce draw over the whole model.

The shipped surrogate (:mod:`kvsieve.policies.kvzap`) spends its budget globally, as KVzip does: after the
header every layer and head keeps, the model's whole budget goes to the best predicted scores of any
layer and head. A stochastic rollout keeps that rule and perturbs the scores: with the keep logits
``s / temperature`` (``s`` the predicted log KVzip score) plus independent Gumbel noise, the global
top-k over every free entry of every layer is an exact Plackett-Luce draw without replacement from
that pool (the Gumbel-top-k trick, :mod:`kvsieve.learn.sampling`). So one prefill compression is *one*
decision, whose log-probability is that of the ordered global draw: :func:`kvzap_decision_logits`
recomputes the pool's logits with gradients from the recorded inputs, and
:func:`~kvsieve.learn.rollout.decision_terms` does the rest, as for DistillCache's network.

``temperature`` sets how far rollouts stray from the greedy (deterministic) compression: the log scores
spread over a few units, so at 1 the Gumbel noise (standard deviation 1.28) reshuffles most of the
boundary; 0.25 keeps rollouts close to greedy. Decode-time eviction is refused: the gradient of a
draw needs every candidate's input (its key and value in every KV head), which per-head eviction drops; the
policy itself evicts in decode mode from scores kept with their entries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvsieve.learn.rollout import Decision
from kvsieve.learn.sampling import gumbel_noise
from kvsieve.networks.kvzap_net import KVzapNet
from kvsieve.policies.kvzap import KVzap
from kvsieve.selection import Selection
from kvsieve.signals import Signals

__all__ = ["KVzapRolloutPolicy", "kvzap_decision_logits"]


@dataclass(frozen=True)
class _GlobalRecordingSelection(Selection):
    """Global allocation that also records, for the compression its policy just scored, the global draw order.

    ``pending`` collects per scored layer ``(time, layer, inputs)``; :meth:`allocate` turns them into one
    :class:`Decision` whose ``features`` are per layer (the surrogate's inputs, the signals or None),
    ``protected`` the flat (layers x heads x n) mask of the entries every head keeps anyway (the header) and
    ``order`` the draws, best first.
    """

    decisions: list = field(default_factory=list, compare=False, repr=False)
    pending: list = field(default_factory=list, compare=False, repr=False)

    def allocate(self, scores, budgets, protected_tail=0, _protected=None):
        picked = super().allocate(scores, budgets, protected_tail, _protected)
        pending, self.pending[:] = list(self.pending), []
        if _protected is not None or len(pending) != len(scores):  # not the prefill's global pick of the scored layers
            return picked
        b, h = scores[0].shape[:2]
        masks, pools, floors = [], [], 0
        for s, kept in zip(scores, budgets):
            n = s.shape[-1]
            protected = self.protected_mask(n, kept, protected_tail or 0, s.device)
            if not protected.any():
                raise ValueError("a kvzap rollout needs protected entries (the header) in every head: without them "
                                 "each head's floor of one entry is chosen greedily, outside the Plackett-Luce draw")
            floors += h * int(protected.sum())
            masks.append(protected.expand(h, n).reshape(-1))
            pools.append(s.double().masked_fill(protected, float("-inf")).reshape(b, h * n))
        take = h * sum(budgets) - floors
        if take > 0:
            order = torch.topk(torch.cat(pools, dim=-1), take, dim=-1, sorted=True).indices
            features = [(layer, inputs) for _, layer, inputs in pending]
            self.decisions.append(Decision(pending[0][0], -1, features, torch.cat(masks), order))
        return picked


class KVzapRolloutPolicy(KVzap):
    """The surrogate in REINFORCE: keep logits ``s / temperature``, Gumbel-perturbed (sampling) or plain (greedy)."""

    name = "kvzap_rollout"

    def __init__(self, net: KVzapNet, meta: dict, temperature: float, generator: torch.Generator | None,
                 record: bool = True, shared: dict | None = None) -> None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        self.temperature, self.generator, self.record = float(temperature), generator, record
        # per layer (scores, inputs), shared by the rollouts that compress copies of one cache with the same
        # weights (one training step's rollouts on its request): scored once, not once per rollout
        self.shared = shared
        self._setup(net, meta, None, None, "global", None)

    def default_selection(self) -> Selection:
        return _GlobalRecordingSelection(sink=self.header, allocation="global", adaptive_floor=0.0)

    @property
    def decisions(self) -> list[Decision]:
        return self.selection.decisions

    @torch.no_grad()
    def score(self, signals: Signals) -> torch.Tensor:
        start = time.perf_counter()
        # the scores through the shipped policy's own path (KVzap._score_all: the linear variant with its
        # standardisation folded in), so the greedy rollout keeps exactly what kvzap keeps; the inputs recorded
        # for the gradient give the same logits up to float rounding
        known = self.shared.get(signals.layer_idx) if self.shared is not None else None
        if known is None or (self.record and known[1] is None):
            seconds, calls = self.overhead_seconds, self.overhead_calls  # counted once, below
            inputs = (self.inputs(signals), self.signal_inputs(signals)) if self.record else None
            known = (self._score_all(signals) / self.temperature, inputs)
            self.overhead_seconds, self.overhead_calls = seconds, calls
            if self.shared is not None:
                self.shared[signals.layer_idx] = known
        logits, inputs = known
        if self.generator is not None:
            logits = logits + gumbel_noise(logits.shape, self.generator, logits.device)
        # the greedy baseline only needs the decision time: no inputs kept
        self.selection.pending.append((signals.future_position, signals.layer_idx, inputs))
        self.overhead_seconds += time.perf_counter() - start
        self.overhead_calls += 1
        return logits

    def decision_logits(self, net: KVzapNet, decision: Decision) -> torch.Tensor:
        return kvzap_decision_logits(net, decision, self.variant, self.temperature)


def kvzap_decision_logits(net: KVzapNet, decision: Decision, variant: str, temperature: float) -> torch.Tensor:
    """(b, layers x heads x n) keep logits of one global decision, with gradients, in the draw's flat order; each
    layer's recorded features are (the surrogate's inputs, the signals or None)."""
    parts = [net(x, layer, variant, signals).transpose(1, 2).reshape(x.shape[0], -1)
             for layer, (x, signals) in decision.features]
    return torch.cat(parts, dim=-1) / temperature
