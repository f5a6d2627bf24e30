"""One episode of eviction decisions on one training sample, and its per-step rewards.

An episode is a context and a reference continuation (the question and the reference answer), read
with teacher forcing. DistillCache casts eviction as a sequential decision problem with a per-step KL
reward (paper abstract); the two modes here:

* ``decode``: the context and the continuation are consumed in chunks of ``chunk_size`` tokens under
  ``kvsieve.attach(mode="decode")``; after every chunk that leaves a layer over its budget, the policy
  chooses what to evict (one decision per layer and step). Step ``i``'s reward is minus the KL,
  summed over the positions from its eviction to the next one (the "following tokens"), divided by
  the number of scored positions, so the episode's reward is minus the mean KL per token.
* ``prefill``: one decision at the end of the context (every layer pruned once, as in prefill
  compression); its reward is minus the mean KL over the continuation's positions.

The full-cache distributions (:class:`~kvsieve.learn.reward.Teacher`) come from the same forward
with nothing evicted (the same chunks in decode mode, so the numerics match and a rollout that
evicts nothing has a KL of exactly zero), computed once per episode by the caller and cached.

A stochastic rollout adds Gumbel noise to the keep logits: the selection's top-k on the perturbed
scores is then a Plackett-Luce draw without replacement among the entries the selection does not
protect (:mod:`kvsieve.learn.sampling`). :class:`RolloutPolicy` records each layer's features and its
selection records the draw order, which is all :func:`decision_terms` needs to recompute the exact
log-probability with gradients.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import clone_cache
from kvsieve.engine.compress import compress_cache
from kvsieve.engine.reader import Capture, read_prompt
from kvsieve.learn.reward import Teacher, kl_per_position, teacher_from_logits
from kvsieve.learn.sampling import first_choice_entropy, gumbel_noise, log_prob_of_ordered
from kvsieve.networks.keep_net import KeepNet
from kvsieve.networks.model_shape import ModelShape
from kvsieve.policies.learned import LearnedPolicy
from kvsieve.selection import Budget, Selection

__all__ = ["Episode", "Decision", "Rollout", "RolloutPolicy", "teacher_for", "rollout", "decision_terms",
           "context_cache_for", "continuation_logits", "step_returns", "keepnet_logits"]


@dataclass
class Episode:
    """Token ids of one training sample: ``context`` (1, n) is evicted from, ``continuation`` (1, m) scored."""

    context: torch.Tensor
    continuation: torch.Tensor
    name: str = ""

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.context, self.continuation], dim=1)


@dataclass
class Decision:
    """One layer's eviction choice: features, the protected entries and the drawn (free) entries in order."""

    time: int  # tokens the layer had seen when it chose: positions >= time feel the choice
    layer: int
    # (b, h, n, F), or [(layer, inputs)] for a kvzap decision over every layer; None where not recorded (greedy)
    features: torch.Tensor | list | None
    protected: torch.Tensor | None = None  # (n,) bool, or flat (layers x heads x n,) for a global decision
    order: torch.Tensor | None = None  # (b, h, k) drawn entries, first draw first ((b, k) flat when global)


@dataclass(frozen=True)
class _RecordingSelection(Selection):
    """A Selection that also records, for the decision its policy just scored, which free entries it drew."""

    decisions: list = field(default_factory=list, compare=False, repr=False)

    def kept_indices(self, scores, kept, protected_tail=0):
        indices, valid = super().kept_indices(scores, kept, protected_tail)
        if self.decisions:
            decision = self.decisions[-1]
            protected = self.protected_mask(scores.shape[-1], kept, protected_tail, scores.device)
            free = kept - int(protected.sum())
            if free > 0:
                ranked = scores.double().masked_fill(protected, float("-inf"))
                decision.protected = protected
                decision.order = torch.topk(ranked, free, dim=-1, sorted=True).indices
        return indices, valid


class RolloutPolicy(LearnedPolicy):
    """The learned policy during training: Gumbel-perturbed scores (sampling) or plain ones (greedy)."""

    name = "learned_rollout"

    def __init__(self, net: KeepNet, trained_for: ModelShape, window: int, generator: torch.Generator | None,
                 record: bool = True, temperature: float = 1.0) -> None:
        self.checkpoint = None
        self.generator = generator  # None: greedy (the deterministic policy)
        self.record = record
        self.temperature = temperature  # keep logits = network output / temperature
        self._setup(net, trained_for, window)

    def default_selection(self) -> Selection:
        return _RecordingSelection(recent=self.window)

    @property
    def decisions(self) -> list[Decision]:
        return self.selection.decisions

    def score(self, signals):
        start = time.perf_counter()
        features, logits = self.logits(signals)
        logits = logits / self.temperature
        if self.generator is not None:
            logits = logits + gumbel_noise(logits.shape, self.generator, logits.device)
        # the greedy baseline only needs the decision times: no features kept
        self.decisions.append(Decision(signals.future_position, signals.layer_idx, features if self.record else None))
        self.overhead_seconds += time.perf_counter() - start
        self.overhead_calls += 1
        return logits


@dataclass
class Rollout:
    kl: torch.Tensor  # (T,) KL per scored position
    start: int  # position of kl[0] in the episode
    decisions: list[Decision]
    overhead_seconds: float

    @property
    def reward(self) -> float:
        return -float(self.kl.mean()) if self.kl.numel() else 0.0


@torch.no_grad()
def context_cache_for(model, episode: Episode, window: int, hidden_states: bool = False):
    """The full cache of ``episode``'s context (``hidden_states``: its layers keep their input hidden states too)."""
    return read_prompt(model, episode.context, Capture(window=window, hidden_states=hidden_states)).cache


@torch.no_grad()
def continuation_logits(model, cache, episode: Episode, window: int) -> torch.Tensor:
    """Logits of the continuation read on ``cache`` (which it extends), nothing evicted."""
    with attach(model, Capture(window=window).policy()):
        return model(input_ids=episode.continuation, cache=cache, use_cache=True).logits[0]


@torch.no_grad()
def _decode_logits(model, episode: Episode, policy, kept: int, chunk_size: int) -> torch.Tensor:
    with attach(model, policy, kept=kept, mode="decode", chunk_size=chunk_size):
        return model(input_ids=episode.ids, use_cache=True).logits[0]


@torch.no_grad()
def teacher_for(model, episode: Episode, mode: str, window: int, chunk_size: int, top_k: int | None,
                context_cache=None) -> Teacher:
    """Full-cache distributions at the positions a rollout is scored on, whatever its budget.

    Prefill mode: the continuation's positions. Decode mode: every position after the first chunk
    (nothing can be evicted before it ends; positions before the first eviction have a KL of exactly 0).
    """
    if mode == "prefill":
        cache = clone_cache(context_cache if context_cache is not None else context_cache_for(model, episode, window))
        return teacher_from_logits(continuation_logits(model, cache, episode, window), episode.context.shape[1], top_k)
    total = episode.ids.shape[1]
    if total <= chunk_size:
        raise ValueError(f"episode {episode.name!r} has {total} tokens, not more than one chunk ({chunk_size}): "
                         "nothing follows an eviction; use a smaller chunk_size or longer samples")
    logits = _decode_logits(model, episode, Capture(window=window).policy(), total, chunk_size)
    return teacher_from_logits(logits[chunk_size:], chunk_size, top_k)


@torch.no_grad()
def rollout(model, episode: Episode, policy: RolloutPolicy, mode: str, kept: int, chunk_size: int,
            teacher: Teacher, context_cache=None) -> Rollout:
    """Run ``policy`` on ``episode`` with a budget of ``kept`` entries per layer and head; KL to ``teacher``."""
    policy.decisions.clear()
    before = policy.overhead_seconds
    if mode == "prefill":
        cache = clone_cache(context_cache if context_cache is not None else context_cache_for(model, episode,
                                                                                           policy.window))
        compress_cache(cache, policy, Budget(kept=kept))
        logits = continuation_logits(model, cache, episode, policy.window)
    else:
        logits = _decode_logits(model, episode, policy, kept, chunk_size)[teacher.start:]
    total = episode.ids.shape[1]
    decisions = [d for d in policy.decisions if d.order is not None and d.time < total]
    return Rollout(kl_per_position(teacher, logits), teacher.start, decisions, policy.overhead_seconds - before)


def step_returns(result: Rollout) -> dict[int, float]:
    """Reward-to-go of every decision time: minus the KL summed from that time on, over the scored positions."""
    times = sorted({d.time for d in result.decisions})
    if not times or not result.kl.numel():
        return {}
    positions = torch.arange(result.start, result.start + result.kl.numel())
    scale = result.kl.numel()
    return {t: -float(result.kl[positions >= t].sum()) / scale for t in times}


def keepnet_logits(net: KeepNet, decision: Decision) -> torch.Tensor:
    """(b, h, n) keep logits of one layer's decision, with gradients."""
    return net(decision.features)


def decision_terms(net: torch.nn.Module, decisions: list[Decision], logits_of=keepnet_logits,
                   ) -> tuple[dict[int, torch.Tensor], torch.Tensor, int]:
    """Per decision time, the Plackett-Luce log-probability of the draws (with gradients); the mean
    normalised first-choice entropy (entropy / log of the free entries, in [0, 1]); the number of draws.

    ``logits_of(net, decision)`` recomputes a decision's keep logits from what it recorded: per layer for
    DistillCache's network (:func:`keepnet_logits`), over every layer at once for the surrogate
    (:func:`kvsieve.learn.kvzap_rollout.kvzap_decision_logits`)."""
    log_probs: dict[int, torch.Tensor] = {}
    entropies, draws = [], 0
    for d in decisions:
        logits = logits_of(net, d).masked_fill(d.protected, float("-inf"))
        log_probs[d.time] = log_probs.get(d.time, 0.0) + log_prob_of_ordered(logits, d.order).sum()
        free = int((~d.protected).sum())
        if free > 1:
            entropies.append((first_choice_entropy(logits) / math.log(free)).mean())
        draws += d.order.numel()
    entropy = torch.stack(entropies).mean() if entropies else torch.zeros(())
    return log_probs, entropy, draws
