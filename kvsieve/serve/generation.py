"""One request's prefill at its own point, and what it costs in KV bytes.

The prefill runs under the request's own ``kvsieve.attach`` (prefill mode): the prompt's cache is compressed
at the request's point, then the question is read (query-agnostic points) and the cache is handed to the
scheduler's running decode batch. A policy that fails while compressing (a program stopped by the
interpreter's limits, a checkpoint that raises) does not fail the request: it is prefilled again at full KV
and answered with ``status: "fallback"`` and the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.cache import cache_bytes, full_cache_bytes
from kvsieve.engine.generate import prefill_prompt
from kvsieve.prompt import Prompt
from kvsieve.risk.runtime import OperatingPoint
from kvsieve.serve.points import ChosenPoint

__all__ = ["Cancelled", "CacheInfo", "Completion", "Prefilled", "bytes_per_token", "prefill"]


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
    first_token_seconds: float | None = None  # from the start of the prefill
    extra: dict = field(default_factory=dict)


@dataclass
class Prefilled:
    cache: DynamicCache
    logits: torch.Tensor  # (vocab,) the next-token logits after the prompt
    info: CacheInfo


def bytes_per_token(model) -> int:
    """KV bytes one token costs in every layer (keys and values of every KV head), at the model's dtype.

    Counts every layer as full attention: an upper bound for models with sliding-window layers."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    size = next(model.parameters()).element_size()
    return int(config.num_hidden_layers * 2 * heads * head_dim * size)


def _run(model, prompt: Prompt, point: OperatingPoint) -> tuple[DynamicCache, torch.Tensor, CacheInfo]:
    n, m = prompt.context_ids.shape[1], prompt.question_ids.shape[1]
    question_aware = point.question_aware and point.compresses
    start = time.perf_counter()
    with point.attach(model, m) as session:
        out = prefill_prompt(model, prompt, question_aware)
        cache = out.cache
        info = CacheInfo(n, n + m, full_cache_bytes(cache), cache_bytes(cache), list(session.kept_tokens), 0.0)
        if not question_aware:
            out = model(input_ids=prompt.question_ids, cache=cache, use_cache=True, logits_to_keep=1)
    info.prefill_seconds = time.perf_counter() - start
    return cache, out.logits[0, -1], info


@torch.no_grad()
def prefill(model, prompt: Prompt, chosen: ChosenPoint) -> Prefilled:
    """The prompt's cache at ``chosen``'s point (question-aware points prefill context + question together),
    and the logits of the first answer token; full KV, with the reason, when the policy fails."""
    try:
        cache, logits, info = _run(model, prompt, chosen.point)
    except Exception as err:  # noqa: BLE001 - any failure of the policy is answered at full KV, not 500
        if not chosen.compresses:
            raise  # full KV failed: the model's fault, not a policy's
        reason = (f"policy {chosen.point.policy_spec}@{chosen.point.ratio:g} failed while compressing "
                  f"({type(err).__name__}: {err}); answered at full KV")
        chosen = ChosenPoint(OperatingPoint.full(chosen.point.bucket, reason[:500]), "fallback")
        cache, logits, info = _run(model, prompt, chosen.point)
    info.chosen = chosen
    return Prefilled(cache, logits, info)
