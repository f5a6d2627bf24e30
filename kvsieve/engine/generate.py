"""One request end to end: chat template, compressed prefill, greedy answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvsieve.engine.attach import DEFAULT_EVICT_EVERY, attach
from kvsieve.engine.cache import cache_bytes, full_cache_bytes, sieve_layers
from kvsieve.engine.compress import CompressionReport
from kvsieve.engine.reader import Capture, first_part, read_prompt
from kvsieve.policy import FullCache, Policy
from kvsieve.prompt import build_prompt
from kvsieve.recall import Recall
from kvsieve.selection import Budget

__all__ = ["Generation", "eos_ids", "greedy_decode", "generate", "check_context_length", "model_context_length"]


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end an answer: the generation config's, the model config's and the tokenizer's."""
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


@torch.no_grad()
def greedy_decode(
    model, tokenizer, cache, logits: torch.Tensor, max_new_tokens: int, stop: tuple[str, ...] = (),
    settled: Callable[[int, list[int]], bool] | None = None, positions: torch.Tensor | None = None,
) -> list[list[int]]:
    """Greedy tokens for each row after ``logits`` (b, vocab); a row ends at EOS, a stop string or the limit,
    and, when ``settled(row, tokens)`` is given, as soon as it says the row's outcome is decided (a caller that
    only needs a score that further tokens cannot change: ``tasks.metrics.settled``; or a row's own limit).

    Rows of a batch share the cache's batch dimension; a finished row is dropped from the cache
    (``batch_select_indices``), so a batch costs the sum of its answers' lengths, not rows x longest.
    ``positions`` (b,): the position of each row's first new token, for rows that have read prompts of different
    lengths (stacked caches of several requests); default: the cache's length, the same for every row.
    """
    if positions is not None and tuple(positions.shape) != (logits.shape[0],):
        raise ValueError(f"positions must hold one position per row ({logits.shape[0]}), got shape "
                         f"{tuple(positions.shape)}")
    eos = eos_ids(model, tokenizer)
    tokens: list[list[int]] = [[] for _ in range(logits.shape[0])]
    active = list(range(logits.shape[0]))  # original row of each row still in the cache
    for step in range(max_new_tokens):
        chosen = logits.argmax(dim=-1)
        keep = []
        for i, row in enumerate(active):
            token = int(chosen[i])
            if token in eos:
                continue
            tokens[row].append(token)
            if stop and any(s in tokenizer.decode(tokens[row]) for s in stop):
                continue
            if settled is None or not settled(row, tokens[row]):
                keep.append(i)
        if not keep or step + 1 == max_new_tokens:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, device=chosen.device)
            cache.batch_select_indices(index)
            chosen, active = chosen[index], [active[i] for i in keep]
            positions = None if positions is None else positions[index.to(positions.device)]
        where = {} if positions is None else {"position_ids": (positions + step)[:, None]}
        logits = model(input_ids=chosen[:, None], cache=cache, use_cache=True, **where).logits[:, -1]
    return tokens


def model_context_length(model) -> int | None:
    """Positions the model was trained for (``max_position_embeddings``), ``None`` if it does not say."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def check_context_length(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a request whose prompt plus answer runs past the model's context."""
    limit = model_context_length(model)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise ValueError(
            f"the prompt ({prompt_tokens} tokens) plus max_new_tokens={max_new_tokens} is longer than the model's "
            f"context of {limit} tokens (max_position_embeddings): shorten the context or the answer")


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    context_tokens: int
    kept_tokens: list[int]  # per compressed layer, after the prompt (before decoding)
    cache_bytes_full: int
    cache_bytes_kept: int
    prefill_seconds: float
    decode_seconds: float
    report: CompressionReport | None
    peak_cache_bytes: int = 0  # largest cache held during any forward (decode mode: before its eviction)
    cold_bytes: int = 0  # with recall: the evicted entries in the cold tier
    moved_bytes: int = 0  # with recall: what the question brought back from it


@torch.no_grad()
def generate(
    model,
    tokenizer,
    context: str,
    question: str,
    policy: Policy | None = None,
    ratio: float | None = None,
    kept: int | None = None,
    question_aware: bool = False,
    answer_prefix: str = "",
    max_new_tokens: int = 32,
    stop: tuple[str, ...] = (),
    mode: str = "prefill",
    chunk_size: int = 512,
    evict_every: int = DEFAULT_EVICT_EVERY,
    recall: Recall | None = None,
) -> Generation:
    """Answer ``question`` about ``context`` with the cache compressed by ``policy``.

    ``policy`` is a :class:`~kvsieve.policy.Policy` (``None``: the full cache), never a name.
    Query-agnostic by default: the context is prefilled and compressed before the question is seen.
    ``question_aware=True`` prefills context and question together (the question is the observation
    window and is always kept). ``recall``: what the policy evicts moves to a cold tier and the question brings the
    entries it attends to most back (``engine/tiers.py``), the recalled share inside the point's ``ratio``. A prompt
    plus ``max_new_tokens`` longer than the model's context (``max_position_embeddings``) is refused: positions it was
    never trained on give garbage.
    """
    policy = FullCache() if policy is None else policy
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a kvsieve Policy, got {type(policy).__name__} {policy!r}: build one with "
                        "kvsieve.policies.get(name) or kvsieve.policies.from_spec(spec)")
    if ratio is None and kept is None:
        ratio = 0.0
    prompt = build_prompt(tokenizer, context, question, answer_prefix)
    n_ctx = prompt.context_ids.shape[1]
    check_context_length(model, n_ctx + prompt.question_ids.shape[1], max_new_tokens)
    if recall is not None and (mode == "decode" or question_aware or kept is not None or not policy.evicts
                               or not ratio):
        raise ValueError("recall runs a query-agnostic prefill point of an evicting policy given by a ratio > 0: not "
                         "with decode mode, question_aware or kept")
    start = time.perf_counter()
    read, tiers = None, None
    if mode == "decode":  # eviction while the prompt is read: nothing is read whole
        held = attach(model, policy, ratio=ratio, kept=kept, mode=mode, chunk_size=chunk_size, evict_every=evict_every)
    else:
        capture = Capture.of([policy])
        read = read_prompt(model, first_part(prompt, question_aware), capture,
                           protected_tail=prompt.question_ids.shape[1] if question_aware else 0)
        held = attach(model, capture.policy())
    with held as session:
        if read is None:
            out = model(input_ids=first_part(prompt, question_aware), use_cache=True, logits_to_keep=1)
            cache, logits, report, read_bytes = out.cache, out.logits[:, -1], session.report, 0
        elif recall is not None:  # the question's read below recalls into this armed copy of the hot tier
            tiers = read.tiered(policy, ratio, recall)
            cache, report, logits, read_bytes = tiers.question_cache(), tiers.report, None, cache_bytes(read.cache)
            read = None
        else:
            cache, report = read.pruned(policy, Budget(ratio=ratio, kept=kept) if policy.evicts else None)
            logits, read_bytes = read.logits, cache_bytes(read.cache)
            read = None  # the full cache goes: only the pruned copy is kept
        kept_tokens = [layer.physical_length for _, layer in sieve_layers(cache)]
        bytes_kept = cache_bytes(cache)
        bytes_full = full_cache_bytes(cache)
        if not question_aware:
            logits = model(input_ids=prompt.question_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        if tiers is not None:  # what attention read while answering: the hot tier and what the question recalled
            bytes_kept = tiers.hot_nbytes() + tiers.moved_bytes
        prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        tokens = greedy_decode(model, tokenizer, cache, logits, max_new_tokens, stop)[0]
    decode_seconds = time.perf_counter() - start
    return Generation(
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        token_ids=tokens,
        context_tokens=n_ctx,
        kept_tokens=kept_tokens,
        cache_bytes_full=bytes_full,
        cache_bytes_kept=bytes_kept,
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        report=report if report is not None else CompressionReport(),
        peak_cache_bytes=max(read_bytes, session.peak_cache_bytes),
        cold_bytes=0 if tiers is None else tiers.cold_nbytes(),
        moved_bytes=0 if tiers is None else tiers.moved_bytes,
    )
