"""One request on the model: the engine's compressed prefill and its greedy decoding loop.

The decoding loop is the engine's ``greedy_decode``; tokens are observed as they are fed back into the
model (a forward pre-hook), which is also where a cancelled request (the client went away) is stopped: the
hook raises, the ``attach`` block exits and the request's cache is dropped with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvsieve.engine.cache import cache_bytes, full_cache_bytes
from kvsieve.engine.generate import greedy_decode, prefill_prompt
from kvsieve.prompt import Prompt
from kvsieve.risk.runtime import OperatingPoint
from kvsieve.serve.text_stream import IncrementalText, cut_at_stop

__all__ = ["Cancelled", "CacheInfo", "Completion", "generate_completion"]


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


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    cache: CacheInfo
    decode_seconds: float
    first_token_seconds: float | None = None  # from the start of the prefill
    extra: dict = field(default_factory=dict)


@torch.no_grad()
def generate_completion(model, tokenizer, prompt: Prompt, point: OperatingPoint, max_tokens: int,
                        stops: tuple[str, ...] = (), cancelled: threading.Event | None = None,
                        on_prefilled: Callable[[CacheInfo], None] | None = None,
                        on_text: Callable[[str], None] | None = None) -> Completion:
    """Prefill ``prompt`` at ``point`` (question-aware points prefill context + question together), then decode.

    ``on_text`` receives text deltas that concatenate to ``Completion.text``; raises :class:`Cancelled` once
    ``cancelled`` is set (checked before every forward)."""
    cancelled = cancelled or threading.Event()
    stream = IncrementalText(tokenizer, stops)
    tokens: list[int] = []
    state = {"decoding": False, "first": None}
    start = time.perf_counter()

    def observe(_module, _args, kwargs):
        if cancelled.is_set():
            raise Cancelled()
        if state["decoding"]:
            if state["first"] is None:
                state["first"] = time.perf_counter() - start
            tokens.append(int(kwargs["input_ids"][0, -1]))
            if on_text is not None:
                delta = stream.push(tokens)
                if delta:
                    on_text(delta)

    n, m = prompt.context_ids.shape[1], prompt.question_ids.shape[1]
    question_aware = point.question_aware and not point.fell_back
    hook = model.register_forward_pre_hook(observe, with_kwargs=True)
    try:
        with point.attach(model, m) as session:
            out = prefill_prompt(model, prompt, question_aware)
            cache = out.cache
            info = CacheInfo(n, n + m, full_cache_bytes(cache), cache_bytes(cache), list(session.kept_tokens), 0.0)
            if not question_aware:
                out = model(input_ids=prompt.question_ids, cache=cache, use_cache=True, logits_to_keep=1)
            info.prefill_seconds = time.perf_counter() - start
            if on_prefilled is not None:
                on_prefilled(info)
            decode_start = time.perf_counter()
            state["decoding"] = True
            ids = greedy_decode(model, tokenizer, cache, out.logits[:, -1], max_tokens, stops)[0]
            decode_seconds = time.perf_counter() - decode_start
    finally:
        hook.remove()
    if state["first"] is None and ids:  # one token only: it was never fed back
        state["first"] = time.perf_counter() - start
    text, stopped = cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stops)
    if on_text is not None:
        rest = stream.finish(text)
        if rest:
            on_text(rest)
    finish = "stop" if stopped or len(ids) < max_tokens else "length"
    return Completion(text, ids, finish, info, decode_seconds, state["first"])
