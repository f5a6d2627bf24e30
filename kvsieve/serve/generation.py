"""One request's prefill at its own point, read in bounded chunks, and what it costs in KV bytes.

A prefill is a small state machine the scheduler advances by at most a token budget per step (chunked prefill),
so one long prompt never holds up the running streams for longer than one chunk:

1. **read**: the first part of the prompt (``engine/reader.first_part``: the context; context + question for a
   question-aware point), chunk by chunk, by the engine's :class:`~kvsieve.engine.reader.PromptReader` capturing
   what the request's policy reads; nothing is compressed yet. Causal attention makes the cache of a prompt read in
   chunks the cache of the prompt read at once.
2. **compress**: at the end of that part, the request's policy prunes the read at its ratio exactly as every verb
   does (``PromptRead.pruned``; KVzip's reconstruction runs here, in one piece: it repeats the whole context).
3. **question**: a query-agnostic point then reads the question, chunk by chunk, on the pruned cache.

The room the cache's segments get is set here, never left to the store's growth rule (an eighth, at least 64
entries): after the first chunk every segment gets room for exactly the rest of the part being read; after the
compression, for exactly the question's tokens plus the request's **room**: ``max_tokens``, or ``evict_every`` for
a row that also evicts while it decodes (``ChosenPoint.room``; its intrinsic scores are then kept with the entries,
``serve/decode_eviction.py``). So a request never allocates more than it was admitted for
(``b x (prompt + max_tokens)``, ``b`` one token's bytes in every layer): every segment's capacity is at most its
longest segment's need, which is at most the prompt plus ``max_tokens``.

With the server's context cache (``serve/contexts.py``), a query-agnostic point's prefill whose context begins with a
stored one skips steps 1 and 2: the rest of its prompt is read on a copy of the stored context (recall's armed copy
of the hot tier); one that reads its context itself hands the compressed context over to be stored
(:attr:`Prefill.to_store`) once it joins the batch.

A policy that fails (a program stopped by the interpreter's limits, a checkpoint that raises) does not fail the
request: the prefill starts again at full KV and is answered with ``status: "fallback"`` and the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.cache import cache_bytes, clone_cache, full_cache_bytes, reserve_room, sieve_layers
from kvsieve.engine.reader import Capture, PromptReader, first_part
from kvsieve.engine.tiers import LayerRecall
from kvsieve.prompt import Prompt
from kvsieve.serve.contexts import StoredContext
from kvsieve.serve.points import ChosenPoint

__all__ = ["Cancelled", "CacheInfo", "Completion", "Prefill", "bytes_per_token"]


class Cancelled(Exception):
    """The request was cancelled (its client disconnected) before it finished."""


@dataclass
class CacheInfo:
    """What compression did to this request's cache, known once the prompt is prefilled."""

    context_tokens: int
    prompt_tokens: int
    bytes_full: int
    bytes_kept: int
    kept_tokens: list[int]
    prefill_seconds: float
    chosen: ChosenPoint | None = None  # the point that ran: the request's, or full KV after a policy failure
    cold_bytes: int = 0  # with recall: the evicted entries in the cold tier
    moved_bytes: int = 0  # with recall: what the question brought back from it (known once the prompt is read)
    context_cache: str | None = None  # "hit": the context came from the server's context cache; "miss": read whole


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    cache: CacheInfo
    decode_seconds: float
    first_token_seconds: float | None = None  # from the request's arrival
    token_gaps: list[float] = field(default_factory=list)  # seconds between successive generated tokens


def bytes_per_token(model) -> int:
    """KV bytes one token costs in every layer (keys and values of every KV head), at the model's dtype.

    Counts every layer as full attention: an upper bound for models with sliding-window layers."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    size = next(model.parameters()).element_size()
    return int(config.num_hidden_layers * 2 * heads * head_dim * size)


class Prefill:
    """One request's prefill, advanced by :meth:`advance` a bounded number of tokens at a time (module doc)."""

    def __init__(self, model, prompt: Prompt, chosen: ChosenPoint, max_tokens: int,
                 context: StoredContext | None = None, scope: str | None = None) -> None:
        """``context``: a stored context the prompt's context begins with (read the rest on a copy of it);
        ``scope``: with a context cache, the scope a context this prefill reads is stored under (None: not kept)."""
        self.model, self.prompt, self.max_tokens = model, prompt, max_tokens
        self.room = max_tokens
        self.seconds = 0.0
        self.scope = scope
        self.to_store: StoredContext | None = None  # the compressed context, for the server's context cache
        self._start(chosen, context)

    def _start(self, chosen: ChosenPoint, context: StoredContext | None = None) -> None:
        self.chosen = chosen
        self.room = chosen.room(self.max_tokens)
        self.question_aware = chosen.setting.protects_question
        self.capture = Capture.of([chosen.point.policy]) if chosen.setting.compresses else Capture()
        self.question: PromptReader | None = None  # a query-agnostic point's question, read on the pruned cache
        self.pruned: DynamicCache | None = None
        self.armed: list[LayerRecall] = []  # this request's recalls into its copy of the hot tier
        self.logits: torch.Tensor | None = None
        self.info: CacheInfo | None = None
        self.reader: PromptReader | None = None
        if context is not None:
            self._continue(context)
        else:
            self.reader = PromptReader(self.model, first_part(self.prompt, self.question_aware), self.capture)

    @property
    def cache(self) -> DynamicCache | None:
        """The request's cache as it stands: the part being read, or the pruned one."""
        if self.question is not None:
            return self.question.cache
        return self.pruned if self.reader is None else self.reader.cache

    @property
    def done(self) -> bool:
        return self.info is not None and (self.question is None or self.question.done)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to read."""
        first = self.reader.remaining if self.reader is not None else 0
        question = self.prompt.question_ids.shape[1] if self.reader is not None and not self.question_aware else 0
        return first + (self.question.remaining if self.question is not None else question)

    @torch.no_grad()
    def advance(self, tokens: int) -> int:
        """Read at most ``tokens`` more prompt tokens (compressing when the first part ends); returns how many were
        read. A compressing policy that fails starts the prefill again at full KV (``info.chosen`` says so)."""
        start = time.perf_counter()
        try:
            return self._advance(tokens)
        except Exception as err:  # noqa: BLE001 - a policy's failure is answered at full KV, not 500
            if not self.chosen.setting.compresses:
                raise  # full KV failed: the model's fault, not a policy's
            self._start(self.chosen.fallback(f"policy {self.chosen.setting} failed while compressing "
                                             f"({type(err).__name__}: {err}); answered at full KV"))
            return 0
        finally:
            self.seconds += time.perf_counter() - start

    def _advance(self, tokens: int) -> int:
        used = 0
        while not self.done and used < tokens:
            if self.reader is not None:
                used += self.reader.advance(tokens - used)
                if self.reader.done:
                    self._compress()
            else:
                used += self.question.advance(tokens - used)
        return used

    def _compress(self) -> None:
        """The end of the first part: compress at the request's point, note what it kept, give every segment room
        for exactly the question (when still to read) and ``max_tokens``; then the question's read, if any."""
        p, chosen = self.prompt, self.chosen
        n, m = p.context_ids.shape[1], p.question_ids.shape[1]
        read = self.reader.finished(m if self.question_aware else 0)
        budget = chosen.setting.budget if chosen.setting.compresses else None
        recall = chosen.setting.mode.recall
        tiers = None
        if recall is not None:  # two tiers: the question's first chunk recalls into this armed copy of the hot tier
            tiers = read.tiered(chosen.point.policy, chosen.setting.ratio, recall)
            cache, hot = tiers.question_cache(), tiers.hot_nbytes()
            self.armed = list(tiers.armed)
        else:  # a row evicting while it decodes keeps an intrinsic policy's scores with the entries
            cache, _ = read.pruned(chosen.point.policy, budget, remember_scores=self.evicts_while_decoding)
            hot = cache_bytes(cache)
        kept = [layer.physical_length for _, layer in sieve_layers(cache)]
        self.info = CacheInfo(n, n + m, full_cache_bytes(cache), hot, kept, 0.0, self.chosen,
                              0 if tiers is None else tiers.cold_nbytes(),
                              context_cache=None if self.scope is None or self.question_aware else "miss")
        if self.scope is not None and not self.question_aware:  # kept as read: the question goes on a copy
            stored = None
            if tiers is None:
                stored, cache = cache, clone_cache(cache)
                for _, layer in sieve_layers(stored):
                    layer.hidden_states = None  # a question reads its own; a stored context needs none
            self.to_store = StoredContext(self.scope, str(chosen.setting), p.context_ids, kept, self.info.bytes_full,
                                          hot=stored, tiers=tiers)
        reserve_room(cache, (0 if self.question_aware else m) + self.room)
        self.reader, self.pruned, self.logits = None, cache, read.logits  # the full cache goes
        if not self.question_aware:
            self.question = PromptReader(self.model, p.question_ids, self.capture, cache)

    def _continue(self, context: StoredContext) -> None:
        """The prompt's context begins with a stored ``context``: read what follows it (the rest of the context, then
        the question) on a copy of it, recalling from its cold tier when it has one; the stored context is left as
        it was."""
        p = self.prompt
        n, m = p.context_ids.shape[1], p.question_ids.shape[1]
        rest = torch.cat([p.context_ids[:, context.length:], p.question_ids], dim=1)
        if context.tiers is not None:
            cache = context.tiers.question_cache()
            self.armed = list(context.tiers.armed)
            hot = context.tiers.hot_nbytes()
        else:
            cache = clone_cache(context.hot)
            hot = cache_bytes(cache)
        full = context.bytes_full * n // context.length  # every layer holds one entry a token at full KV
        self.info = CacheInfo(n, n + m, full, hot, list(context.kept), 0.0, self.chosen, context.cold_bytes,
                              context_cache="hit")
        reserve_room(cache, rest.shape[1] + self.room)
        self.pruned = cache
        self.question = PromptReader(self.model, rest, self.capture, cache)

    @property
    def evicts_while_decoding(self) -> bool:
        """Whether the request's row also evicts while it decodes (its room is below ``max_tokens``)."""
        return self.room < self.max_tokens

    def finished(self) -> tuple[DynamicCache, torch.Tensor, CacheInfo]:
        """The prompt's cache (room for :attr:`room` more entries), the first answer token's logits, its info."""
        if not self.done:
            raise RuntimeError(f"the prefill has {self.remaining} prompt tokens left to read")
        self.info.prefill_seconds = self.seconds
        if self.armed:  # attention reads the hot tier and what the question recalled
            self.info.moved_bytes = sum(a.moved_bytes for a in self.armed)
            self.info.bytes_kept += self.info.moved_bytes
        logits = self.question.logits if self.question is not None else self.logits
        return self.cache, logits[0], self.info
