"""Read a prompt once, prune many copies: the one place kvsieve prefills a prompt it will compress.

Every verb that compresses a prompt reads it here: ``generate``, ``kvsieve eval``'s grid (one read a sample, a
pruned copy a cell), the server (a read advanced a chunk per scheduler step), evolution's dev set and training's
rollouts. Three things live here and nowhere else:

* :class:`Capture`, what a read keeps beside the cache so that policies can score it afterwards (the last queries,
  accumulated attention, query statistics, hidden states), taken as the union of what the policies to be run ask
  (``Capture.of``); :meth:`Capture.policy` is the only non-evicting capture policy kvsieve builds.
* the question-first layout (:func:`first_part`): a question-aware point reads context and question as one part and
  protects the question; a query-agnostic one reads the context alone, compresses, then reads the question.
* :class:`PromptRead`, a prompt read: :meth:`~PromptRead.pruned` hands out a pruned copy per (policy, budget),
  KVzip's reconstruction computed once per scoring setup (:func:`~kvsieve.engine.prune.prune_prompt` dispatches).

In prefill compression a read does not depend on the policy (each layer attends over its full input; only the
cache left behind is pruned), so one read serves every policy and budget, bit for bit what each would get alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import clone_cache, reserve_room
from kvsieve.engine.compress import CompressionReport
from kvsieve.engine.prune import prune_prompt
from kvsieve.engine.reconstruct import Reconstruction, reconstruction_prompt, reconstruction_scores
from kvsieve.engine.tiers import TieredContext
from kvsieve.policy import FullCache, Policy
from kvsieve.prompt import Prompt
from kvsieve.recall import Recall
from kvsieve.selection import Budget

__all__ = ["Capture", "PromptRead", "PromptReader", "first_part", "read_prompt"]


@dataclass(frozen=True)
class Capture:
    """What a read keeps for the policies that will prune it: the last ``window`` queries of every layer, and, when
    asked, each entry's accumulated attention, the pre-RoPE query statistics and the layers' input hidden states."""

    window: int = 64
    accumulated_attention: bool = False
    query_stats: bool = False
    hidden_states: bool = False

    @classmethod
    def of(cls, policies: Iterable[Policy], window: int = 0) -> Capture:
        """The union of what ``policies`` read (their widest window, at least ``window``)."""
        policies = list(policies)
        return cls(window=max([window, *(p.window for p in policies)]) or 64,
                   accumulated_attention=any(p.needs_accumulated_attention for p in policies),
                   query_stats=any(p.needs_query_stats for p in policies),
                   hidden_states=any(p.needs_hidden_states for p in policies))

    def policy(self) -> FullCache:
        """The policy a read runs under: evicts nothing, captures this."""
        capture = FullCache(window=self.window)
        capture.needs_accumulated_attention = self.accumulated_attention
        capture.needs_query_stats = self.query_stats
        capture.needs_hidden_states = self.hidden_states
        return capture


def first_part(prompt: Prompt, question_aware: bool) -> torch.Tensor:
    """The ids read before compression: context and question together for a question-aware point (the question is
    the observation window and is kept on top of the budget), the context alone otherwise."""
    return torch.cat([prompt.context_ids, prompt.question_ids], dim=1) if question_aware else prompt.context_ids


class PromptReader:
    """Reads ``ids`` onto ``cache`` (a new cache when None) under ``capture``, at most a caller's token budget at a
    time (:meth:`advance`; a server's chunked prefill); causal attention makes a prompt read in chunks the prompt
    read at once. After the first of several chunks the cache gets room for exactly the rest."""

    def __init__(self, model, ids: torch.Tensor, capture: Capture, cache: DynamicCache | None = None) -> None:
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"a read needs (batch, tokens) ids with at least one token, got shape {tuple(ids.shape)}")
        self.model, self.ids, self.capture, self.cache = model, ids, capture, cache
        self._policy = capture.policy()
        self.read = 0
        self.logits: torch.Tensor | None = None  # (batch, vocab): the last token's, once done
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return self.read == self.ids.shape[1]

    @property
    def remaining(self) -> int:
        return self.ids.shape[1] - self.read

    @torch.no_grad()
    def advance(self, tokens: int) -> int:
        """Read at most ``tokens`` more ids; returns how many were read."""
        take = min(tokens, self.remaining)
        if take <= 0:
            return 0
        start = time.perf_counter()
        first = self.read == 0
        with attach(self.model, self._policy):
            out = self.model(input_ids=self.ids[:, self.read:self.read + take], cache=self.cache, use_cache=True,
                             logits_to_keep=1)
        self.cache, self.read = out.cache, self.read + take
        if first and not self.done:
            reserve_room(self.cache, self.remaining)
        if self.done:
            self.logits = out.logits[:, -1]
        self.seconds += time.perf_counter() - start
        return take

    def finished(self, protected_tail: int = 0) -> PromptRead:
        """The read, its last ``protected_tail`` ids kept out of compression."""
        if not self.done:
            raise RuntimeError(f"the read has {self.remaining} tokens left")
        return PromptRead(self.model, self.cache, self.ids, self.logits, self.capture, protected_tail, self.seconds)


def read_prompt(model, ids: torch.Tensor, capture: Capture, protected_tail: int = 0) -> PromptRead:
    """``ids`` read whole in one forward (see :class:`PromptReader`)."""
    reader = PromptReader(model, ids, capture)
    reader.advance(ids.shape[1])
    return reader.finished(protected_tail)


@dataclass
class PromptRead:
    """A prompt read whole: its full ``cache`` (never pruned here), the ``ids`` it holds, the last token's
    ``logits``, what was captured, the trailing ids kept out of compression and the read's seconds."""

    model: object
    cache: DynamicCache
    ids: torch.Tensor
    logits: torch.Tensor
    capture: Capture
    protected_tail: int = 0
    seconds: float = 0.0
    reconstructions: dict = field(default_factory=dict)  # KVzip's, one per scoring setup

    @property
    def context_length(self) -> int:
        """Entries a budget is taken of: the prompt read, less its protected tail."""
        return self.ids.shape[1] - self.protected_tail

    def continued(self, ids: torch.Tensor) -> PromptRead:
        """A copy that also reads ``ids`` (a question), kept out of compression: reading context + question at once
        equals reading the context, then the question on its full cache."""
        reader = PromptReader(self.model, ids, self.capture, clone_cache(self.cache))
        reader.advance(ids.shape[1])
        return PromptRead(self.model, reader.cache, torch.cat([self.ids, ids], dim=1), reader.logits, self.capture,
                          self.protected_tail + ids.shape[1], self.seconds + reader.seconds)

    def check(self, policy: Policy) -> None:
        """Refuse a policy this read cannot serve: one reading more queries, statistics or states than were captured,
        or a window longer than the context."""
        captured = Capture.of([policy])
        if (captured.window > self.capture.window or captured.accumulated_attention > self.capture.accumulated_attention
                or captured.query_stats > self.capture.query_stats
                or captured.hidden_states > self.capture.hidden_states):
            raise ValueError(f"policy {policy.name!r} reads {captured}, more than this prompt's read captured "
                             f"({self.capture}): read it with Capture.of([...]) of every policy to be run")
        if policy.evicts and policy.uses_window and self.context_length < policy.window:
            raise ValueError(f"window {policy.window} is larger than the context ({self.context_length} tokens); "
                             "use a smaller window")

    def reconstruction(self, policy: Policy) -> Reconstruction:
        """KVzip's reconstruction of this read for ``policy``'s scoring setup, computed once."""
        key = policy.reconstruction_key()
        if key not in self.reconstructions:
            self.reconstructions[key] = reconstruction_scores(
                self.model, self.cache, self.ids, reconstruction_prompt(policy, self.model), self.protected_tail,
                policy.chunk_size, policy.normalization)
        return self.reconstructions[key]

    def pruned(self, policy: Policy, budget: Budget | None,
               remember_scores: bool = False) -> tuple[DynamicCache, CompressionReport | None]:
        """A copy of the cache pruned by ``policy`` at ``budget`` (None, or a policy that evicts nothing: the full
        copy, no report). The report's seconds include a shared reconstruction's."""
        cache = clone_cache(self.cache)
        if budget is None or not policy.evicts:
            return cache, None
        self.check(policy)
        reconstruction = None
        if policy.needs_reconstruction and budget.resolve(self.context_length) < self.context_length:
            reconstruction = self.reconstruction(policy)
        report = prune_prompt(self.model, cache, self.ids, policy, budget, self.protected_tail,
                              reconstruction=reconstruction, remember_scores=remember_scores)
        return cache, report

    def tiered(self, policy: Policy, ratio: float, recall: Recall,
               cold_folder: str | Path | None = None) -> TieredContext:
        """The read split in two tiers at the point ``ratio`` (``engine/tiers.py``): the policy's pruned copy hot, what
        it evicts cold, recalled from per question."""
        self.check(policy)
        reconstruction = None
        if policy.needs_reconstruction:
            reconstruction = self.reconstruction(policy)
        return TieredContext.split(self.model, self.cache, self.ids, policy, ratio, recall, self.protected_tail,
                                   reconstruction, cold_folder)
