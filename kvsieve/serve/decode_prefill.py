"""A decode-time point's prefill: the prompt read under eviction, a chunk at a time, exactly as the grid read it.

A point in decode mode (``SPEC@decodeC`` or ``SPEC@decodeCeE``: :class:`~kvsieve.policies.label.Mode`) is what
``kvsieve eval --mode decode`` measured and ``kvsieve certify`` certifies: ``attach(mode="decode")`` reads the context
``C`` tokens at a time and evicts the cache back to its per-layer budgets after each chunk (the chunk just read
protected), reads the question the same way, then evicts every ``E`` generated tokens. The server runs that, not a
prefill compression followed by eviction:

* :class:`DecodePrefill` reads the prompt under one engine session carried over the scheduler's steps
  (``engine/attach.open_session`` and ``resume``): the budget is taken of the whole context, every chunk starts where
  the grid's starts (the context's chunks from its first token, the question's from its own), and each is evicted
  where the grid evicts it. A step reads whole chunks, so it may read up to ``C - 1`` tokens past ``--prefill-chunk``.
* once its prompt is read the row joins the decode batch with ``E`` entries of room, and the scheduler evicts it back
  to the same per-layer budgets every ``E`` tokens it takes (``serve/decode_eviction.py``: the budgets travel with
  the cache's layers, ``SieveLayer.budget``, and :func:`~kvsieve.serve.decode_eviction.row_cap` reads them).

So a request at a decode-time point keeps, generates and answers what ``kvsieve eval`` stored for it
(``tests/serve/test_serve_decode_eviction.py`` compares the two bit for bit). A policy that fails while the prompt
is read is answered at full KV with the reason, as a prefill point's is.

:func:`prefill_for` picks the prefill a request's point needs; the scheduler calls it for every job it admits.
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.attach import open_session, resume
from kvsieve.engine.cache import cache_bytes, full_cache_bytes, sieve_layers
from kvsieve.prompt import Prompt
from kvsieve.serve.decode_eviction import hold_room
from kvsieve.serve.generation import CacheInfo, Prefill
from kvsieve.serve.points import ChosenPoint

__all__ = ["DecodePrefill", "prefill_for"]


class DecodePrefill:
    """One request's prefill at a decode-time point, advanced a bounded number of tokens at a time (module doc).
    The same interface as :class:`~kvsieve.serve.generation.Prefill`, which it hands over to (at full KV) when its
    policy fails."""

    to_store = None  # a prompt read under eviction is never kept for the context cache (serve/contexts.py)

    def __init__(self, model, prompt: Prompt, chosen: ChosenPoint, max_tokens: int) -> None:
        setting = chosen.setting
        if not (setting.mode.is_decode and setting.compresses):
            raise ValueError(f"point {setting} does not evict at decode time: read it with Prefill")
        self.model, self.prompt, self.chosen, self.max_tokens = model, prompt, chosen, max_tokens
        self.room = chosen.room(max_tokens)
        self.seconds = 0.0
        n = prompt.context_ids.shape[1]
        self.session = open_session(chosen.point.policy, ratio=setting.ratio, **setting.engine_options,
                                    context_tokens=n)
        self.parts = [prompt.context_ids, prompt.question_ids]
        self.part, self.read = 0, 0  # the part being read, and how much of it
        self.logits: torch.Tensor | None = None
        self.info: CacheInfo | None = None
        self.full: Prefill | None = None  # the full-KV prefill that took over after a failure

    @property
    def cache(self) -> DynamicCache | None:
        return self.full.cache if self.full is not None else self.session.cache

    @property
    def done(self) -> bool:
        return self.full.done if self.full is not None else self.part == len(self.parts)

    @property
    def remaining(self) -> int:
        if self.full is not None:
            return self.full.remaining
        return sum(part.shape[1] for part in self.parts[self.part:]) - self.read

    @property
    def evicts_while_decoding(self) -> bool:
        """Whether the row also evicts while it decodes (its room is below ``max_tokens``)."""
        return self.full.evicts_while_decoding if self.full is not None else self.room < self.max_tokens

    @torch.no_grad()
    def advance(self, tokens: int) -> int:
        """Read whole chunks of the prompt until at least ``tokens`` are read or it ends; returns how many were
        read. A policy that fails hands the prompt to a full-KV prefill (``info.chosen`` says why)."""
        if self.full is not None:
            return self.full.advance(tokens)
        start = time.perf_counter()
        used = 0
        try:
            while not self.done and used < tokens:
                used += self._chunk()
        except Exception as err:  # noqa: BLE001 - a policy's failure is answered at full KV, not 500
            self.full = Prefill(self.model, self.prompt, self.chosen.fallback(
                f"policy {self.chosen.setting} failed while reading the prompt under eviction "
                f"({type(err).__name__}: {err}); answered at full KV"), self.max_tokens)
            return 0
        finally:
            self.seconds += time.perf_counter() - start
        return used

    def _chunk(self) -> int:
        """One chunk of the current part, read and evicted as ``attach(mode="decode")`` reads it."""
        part = self.parts[self.part]
        take = min(self.session.chunk_size, part.shape[1] - self.read)
        # the grid reads each part in one call, so a part of one token is a generated token there (never a prompt's
        # context: the server falls back below two context tokens; nor a chat template's question)
        self.session.reading = part.shape[1] > 1
        with resume(self.model, self.session):
            out = self.model(input_ids=part[:, self.read:self.read + take], cache=self.session.cache, use_cache=True,
                             logits_to_keep=1)
        self.read += take
        if self.read == part.shape[1]:
            self.part, self.read = self.part + 1, 0
            if self.part == 1:  # the context is read: what it kept, as generate(mode="decode") reports it
                cache = self.session.cache
                n, m = self.prompt.context_ids.shape[1], self.prompt.question_ids.shape[1]
                self.info = CacheInfo(context_tokens=n, prompt_tokens=n + m, bytes_full=full_cache_bytes(cache),
                                      bytes_kept=cache_bytes(cache),
                                      kept_tokens=[layer.physical_length for _, layer in sieve_layers(cache)],
                                      prefill_seconds=0.0, chosen=self.chosen)
            else:
                self.logits = out.logits[:, -1]
        return take

    def finished(self) -> tuple[DynamicCache, torch.Tensor, CacheInfo]:
        """The prompt's cache laid out with :attr:`room` entries of room a segment, the first answer token's logits,
        its info."""
        if self.full is not None:
            return self.full.finished()
        if not self.done:
            raise RuntimeError(f"the prefill has {self.remaining} prompt tokens left to read")
        self.info.prefill_seconds = self.seconds
        return hold_room(self.session.cache, self.room), self.logits[0], self.info


def prefill_for(model, prompt: Prompt, chosen: ChosenPoint, max_tokens: int, *args, **kwargs):
    """The prefill a request at ``chosen`` runs: :class:`DecodePrefill` for a decode-time point that compresses, else
    :class:`~kvsieve.serve.generation.Prefill` (given ``args``/``kwargs`` too)."""
    setting = chosen.setting
    if setting.mode.is_decode and setting.compresses:
        return DecodePrefill(model, prompt, chosen, max_tokens)
    return Prefill(model, prompt, chosen, max_tokens, *args, **kwargs)
