"""One request's prefill at its own point, read in bounded chunks, and what it costs in KV bytes.

A prefill is a small state machine the scheduler advances by at most a token budget per step (chunked prefill),
so one long prompt never holds up the running streams for longer than one chunk:

1. **read**: the first part of the prompt (the context; context + question for a question-aware point), chunk by
   chunk, under ``kvsieve.attach`` with a :class:`Gathering` stand-in of the request's policy: the same window,
   attention tracking, query statistics and hidden states are captured, nothing is compressed yet. Causal
   attention makes the cache of a prompt read in chunks the cache of the prompt read at once.
2. **compress**: at the end of that part, the request's policy prunes the cache at its ratio exactly as the
   engine's prefill mode does at the end of its first forward (``compress_cache``; KVzip's reconstruction runs
   here, in one piece: it repeats the whole context).
3. **question**: a query-agnostic point then reads the question, chunk by chunk, on the pruned cache.

The room the cache's segments get is set here, never left to the store's growth rule (an eighth, at least 64
entries): after the first chunk every segment gets room for exactly the rest of the part being read; after the
compression, for exactly the question's tokens plus the request's **room**: ``max_tokens``, or ``evict_every`` for
a row that also evicts while it decodes (``ChosenPoint.room``; its intrinsic scores are then kept with the entries,
``serve/decode_eviction.py``). So a request never allocates more than it was admitted for
(``b x (prompt + max_tokens)``, ``b`` one token's bytes in every layer): every segment's capacity is at most its
longest segment's need, which is at most the prompt plus ``max_tokens``.

A policy that fails (a program stopped by the interpreter's limits, a checkpoint that raises) does not fail the
request: the prefill starts again at full KV and is answered with ``status: "fallback"`` and the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import cache_bytes, full_cache_bytes, reserve_room, sieve_layers
from kvsieve.engine.compress import compress_cache
from kvsieve.engine.reconstruct import compress_with_reconstruction
from kvsieve.policy import FullCache, Policy
from kvsieve.prompt import Prompt
from kvsieve.serve.points import ChosenPoint

__all__ = ["Cancelled", "CacheInfo", "Completion", "Gathering", "Prefill", "bytes_per_token"]


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


class Gathering(Policy):
    """Captures what ``policy`` will read (window queries, accumulated attention, query statistics, hidden states)
    while a prompt is read in chunks, and compresses nothing: the compression runs once the part is read."""

    name = "gathering"
    evicts = False
    uses_window = False

    def __init__(self, policy: Policy) -> None:
        super().__init__(window=policy.window)
        self.needs_accumulated_attention = policy.needs_accumulated_attention
        self.needs_query_stats = policy.needs_query_stats
        self.needs_hidden_states = policy.needs_hidden_states

    def score(self, signals):  # never called: nothing is compressed under it
        raise RuntimeError("Gathering compresses nothing")


class Prefill:
    """One request's prefill, advanced by :meth:`advance` a bounded number of tokens at a time (module doc)."""

    def __init__(self, model, prompt: Prompt, chosen: ChosenPoint, max_tokens: int) -> None:
        self.model, self.prompt, self.max_tokens = model, prompt, max_tokens
        self.room = max_tokens
        self.seconds = 0.0
        self._start(chosen)

    def _start(self, chosen: ChosenPoint) -> None:
        self.chosen = chosen
        self.room = chosen.room(self.max_tokens)
        p = self.prompt
        self.question_aware = chosen.setting.protects_question
        first = torch.cat([p.context_ids, p.question_ids], dim=1) if self.question_aware else p.context_ids
        self.parts = [first] if self.question_aware else [first, p.question_ids]
        self.part, self.read = 0, 0  # the part being read and the tokens of it read so far
        self.gathering = Gathering(chosen.point.policy) if chosen.setting.compresses else FullCache()
        self.cache: DynamicCache | None = None
        self.logits: torch.Tensor | None = None
        self.info: CacheInfo | None = None

    @property
    def done(self) -> bool:
        return self.part == len(self.parts)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to read."""
        return sum(part.shape[1] for part in self.parts[self.part:]) - self.read

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
            part = self.parts[self.part]
            take = min(tokens - used, part.shape[1] - self.read)
            ids = part[:, self.read:self.read + take]
            with attach(self.model, self.gathering):
                out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
                self.cache = out.cache
                self.read += take
                used += take
                if self.read < part.shape[1]:
                    if self.read == take:  # after the first chunk: room for exactly the rest of this part
                        reserve_room(self.cache, part.shape[1] - self.read)
                    continue
                self.logits = out.logits[0, -1]
                self.part, self.read = self.part + 1, 0
                if self.part == 1:
                    self._compress()
        return used

    def _compress(self) -> None:
        """The end of the first part: compress at the request's point, note what it kept, give every segment room
        for exactly the question (when still to read) and ``max_tokens``."""
        p, chosen, cache = self.prompt, self.chosen, self.cache
        n, m = p.context_ids.shape[1], p.question_ids.shape[1]
        if chosen.setting.compresses:
            tail = m if self.question_aware else 0
            budget, policy = chosen.setting.budget, chosen.point.policy
            if policy.needs_reconstruction:  # KVzip: repeats the context over a copy of the cache
                compress_with_reconstruction(self.model, cache, self.parts[0], policy, budget, tail)
            else:  # a row evicting while it decodes keeps an intrinsic policy's scores with the entries
                compress_cache(cache, policy, budget, tail, remember_scores=self.evicts)
        kept = [layer.physical_length for _, layer in sieve_layers(cache)]
        self.info = CacheInfo(n, n + m, full_cache_bytes(cache), cache_bytes(cache), kept, 0.0, self.chosen)
        reserve_room(cache, (0 if self.question_aware else m) + self.room)

    @property
    def evicts(self) -> bool:
        """Whether the request's row also evicts while it decodes (its room is below ``max_tokens``)."""
        return self.room < self.max_tokens

    def finished(self) -> tuple[DynamicCache, torch.Tensor, CacheInfo]:
        """The prompt's cache (room for :attr:`room` more entries), the first answer token's logits, its info."""
        if not self.done:
            raise RuntimeError(f"the prefill has {self.remaining} prompt tokens left to read")
        self.info.prefill_seconds = self.seconds
        return self.cache, self.logits, self.info
