"""``kvsieve.attach``: run a HF model with a policy pruning its KV cache.

Two modes:

* ``prefill``: the first forward on a fresh cache (the prompt) runs untouched; at its end every
  full-attention layer is pruned to the budget. Later forwards (question, generated tokens) use
  the smaller cache, with the original positions.
* ``decode``: the input is consumed in chunks of ``chunk_size`` tokens and after every chunk the
  cache is evicted back to the budget; generated tokens are evicted once every ``evict_every`` of
  them (a policy's cost is then paid once per ``evict_every`` tokens, not per token). The latest
  chunk is protected until the next eviction (it has not been answered yet). A layer never attends
  over more than its budget + ``max(chunk_size, evict_every)`` entries per head on average, which
  bounds peak memory (PyramidKV's layer budgets vary by depth around the mean; AdaKV's heads vary
  around it, stored ragged). ``Session.peak_cache_bytes`` is the largest cache any forward held
  (measured before its eviction), ``Session.peak_tokens`` the most entries one head attended over.

A session may span several blocks: :func:`open_session` makes one and :func:`resume` runs the model under it, so a
reader that spreads one prompt over several calls (the server's decode-time prefill, a chunk a scheduler step,
``serve/decode_prefill.py``) evicts exactly where one ``attach`` block reading it at once would
(``Session.context_tokens``: the budget is taken of the whole context, not of the first forward's tokens;
``Session.reading``: every forward reads prompt tokens, evicted at once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.attention import ATTENTION_NAME
from kvsieve.engine.cache import attached, cache_bytes, install, sieve_layers
from kvsieve.engine.compress import CompressionReport, compress_cache, layer_occupancy
from kvsieve.engine.hidden_states import hidden_states_hooks
from kvsieve.engine.modules import attention_modules
from kvsieve.engine.prune import prune_prompt
from kvsieve.engine.query_hooks import query_stats_hooks
from kvsieve.engine.tiers import TieredContext
from kvsieve.policy import Policy
from kvsieve.recall import Recall
from kvsieve.selection import Budget

__all__ = ["SUPPORTED_MODEL_TYPES", "DEFAULT_EVICT_EVERY", "Session", "attach", "open_session", "resume"]

# Generated tokens between decode-time evictions. At 32 the learned policy's eviction over SmolLM2's 30
# layers (~170 ms) costs ~5 ms per token instead of 170; the cache grows by at most 32 entries a head.
DEFAULT_EVICT_EVERY = 32

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


@dataclass
class Session:
    """What ``attach`` yields: the live cache and what compression did."""

    policy: Policy
    budget: Budget
    mode: Literal["prefill", "decode"]
    chunk_size: int
    protected_tail: int
    cache: DynamicCache | None = None
    report: CompressionReport | None = None
    peak_tokens: int = 0  # most entries any layer attended over in one forward
    budget_tokens: int | None = None  # decode mode: the resolved mean token budget per layer
    layer_budgets: list[int] | None = None  # decode mode: each cache layer's own budget
    evict_every: int = 1  # decode mode: generated tokens between evictions
    pending: int = 0  # decode mode: generated tokens read since the last eviction
    peak_cache_bytes: int = 0  # largest cache held at the end of a forward, before its eviction
    recall: Recall | None = None  # prefill mode: what the prompt's policy evicts goes cold; the next forward recalls
    tiers: TieredContext | None = None  # with recall: the prompt's two tiers, once it is read
    # decode mode: the context tokens a ratio's budget is taken of (None: the first forward's tokens, the context
    # when the prompt is read in one call); a reader spreading the context over several calls gives it
    context_tokens: int | None = None
    # decode mode: every forward reads prompt tokens, a chunk evicted at once even when it is one token (False: a
    # one-token forward is a generated token, evicted every ``evict_every`` of them)
    reading: bool = False

    def layer(self, idx: int):
        return None if self.cache is None else self.cache.layers[idx]

    def observe(self, key_len: int) -> None:
        self.peak_tokens = max(self.peak_tokens, key_len)

    @property
    def kept_tokens(self) -> list[int]:
        return [] if self.cache is None else [layer.physical_length for _, layer in sieve_layers(self.cache)]


def _model_type(model) -> str:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "model_type", type(model).__name__)


@contextlib.contextmanager
def attach(
    model,
    policy: Policy,
    ratio: float | None = None,
    kept: int | None = None,
    mode: Literal["prefill", "decode"] = "prefill",
    chunk_size: int = 512,
    protected_tail: int = 0,
    evict_every: int = DEFAULT_EVICT_EVERY,
    recall: Recall | None = None,
) -> Iterator[Session]:
    """Context manager under which ``model(...)`` and ``model.generate(...)`` run compressed.

    Args:
        policy: a :class:`~kvsieve.policy.Policy` (see ``kvsieve.policies.get``).
        ratio / kept: the budget, a compression ratio in [0, 1) or a kept-token count per layer.
        mode: ``"prefill"`` (compress once at the end of the prompt) or ``"decode"`` (hold the
            cache under the budget while consuming the prompt in chunks and while generating).
        chunk_size: decode mode only, prompt tokens consumed between evictions.
        evict_every: decode mode only, generated tokens between evictions (1: after every token).
        protected_tail: prefill mode, trailing prompt tokens kept on top of the budget (the
            question, in question-aware mode).
        recall: prefill mode, a ratio's point with two tiers (``engine/tiers.py``): what the policy evicts from
            the prompt is kept cold, and the next forward (the question) recalls into the cache, in each layer,
            the entries its queries attend to most; ``session.tiers`` holds both tiers and what was moved.
    """
    session = open_session(policy, ratio, kept, mode, chunk_size, protected_tail, evict_every, recall)
    with resume(model, session):
        yield session


def open_session(
    policy: Policy,
    ratio: float | None = None,
    kept: int | None = None,
    mode: Literal["prefill", "decode"] = "prefill",
    chunk_size: int = 512,
    protected_tail: int = 0,
    evict_every: int = DEFAULT_EVICT_EVERY,
    recall: Recall | None = None,
    context_tokens: int | None = None,
) -> Session:
    """The session :func:`attach` runs under, its arguments checked (see ``attach``); ``context_tokens``: decode
    mode, the context a ratio's budget is taken of when the prompt is read over several calls (:func:`resume`)."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a kvsieve Policy (see kvsieve.policies.get), got {type(policy).__name__}")
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode {mode!r} is not one of 'prefill', 'decode'")
    if mode == "decode" and policy.needs_reconstruction:  # KVzip
        raise ValueError(f"policy {policy.name!r} cannot evict in decode mode: its scores come from the model "
                         "repeating the whole context after the prefill, which decode-time eviction never holds")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if isinstance(evict_every, bool) or not isinstance(evict_every, int) or evict_every < 1:
        raise ValueError(f"evict_every must be a positive int, got {evict_every!r}")
    if isinstance(protected_tail, bool) or not isinstance(protected_tail, int) or protected_tail < 0:
        raise ValueError(f"protected_tail must be an int >= 0, got {protected_tail!r}")
    if context_tokens is not None and (isinstance(context_tokens, bool) or not isinstance(context_tokens, int)
                                       or context_tokens < 1 or mode != "decode"):
        raise ValueError(f"context_tokens is a decode-mode count of context tokens >= 1, got {context_tokens!r} "
                         f"in mode {mode!r}")
    if recall is not None and (mode != "prefill" or kept is not None or ratio is None or not policy.evicts):
        raise ValueError("recall runs a prefill point of an evicting policy given by ratio: not with decode mode, "
                         "kept or a policy that evicts nothing")
    budget = Budget(ratio=ratio, kept=kept) if policy.evicts else Budget(ratio=0.0)
    return Session(policy, budget, mode, chunk_size, protected_tail, evict_every=evict_every, recall=recall,
                   context_tokens=context_tokens)


@contextlib.contextmanager
def resume(model, session: Session) -> Iterator[Session]:
    """Run ``model`` under ``session`` for a block (what :func:`attach` does with the session it opens); a session
    carried over several blocks goes on where the last left it (its cache, budgets and count of generated tokens)."""
    model_type = _model_type(model)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    modules = attention_modules(model)
    configs = {id(c): c for c in [model.config, *(getattr(m, "config", None) for m in modules)] if c is not None}
    saved_impl = {key: c._attn_implementation for key, c in configs.items()}
    # an attach inside another (a read under a decode) wraps the model's own forward, not the outer wrapper, and
    # gives the outer one back its forward and sessions on exit
    outer_forward = model.__dict__.get("forward")
    original_forward = getattr(outer_forward, "kvsieve_unwrapped", model.forward)
    outer_sessions = [module.__dict__.get("_kvsieve_session") for module in modules]
    try:
        for config in configs.values():
            config._attn_implementation = ATTENTION_NAME
        for module in modules:
            module._kvsieve_session = session
        model.forward = _compressing_forward(model, original_forward, session)
        # query statistics and hidden states only if the policy asks
        with attached(), query_stats_hooks(model, session), hidden_states_hooks(model, session):
            yield session
    finally:
        model.__dict__.pop("forward", None)
        if outer_forward is not None:
            model.forward = outer_forward
        for module, outer in zip(modules, outer_sessions):
            module.__dict__.pop("_kvsieve_session", None)
            if outer is not None:
                module._kvsieve_session = outer
        for key, config in configs.items():
            config._attn_implementation = saved_impl[key]


def _compressing_forward(model, forward, session: Session):
    def wrapped(*args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        inputs = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if inputs is None:
            raise ValueError("attach() needs input_ids or inputs_embeds")
        device = model.device
        if input_ids is not None and input_ids.device != device:  # prompts are built on the CPU
            input_ids = input_ids.to(device)
            if "input_ids" in kwargs:
                kwargs["input_ids"] = input_ids
            else:
                args = (input_ids, *args[1:])
            inputs = input_ids
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"].to(device)
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and not bool(mask.all()):
            raise ValueError(
                "padded batches are not supported under kvsieve.attach: pass equal-length, unpadded inputs"
            )
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None and kwargs.get("use_cache", True) is not False:
            cache = DynamicCache(config=model.config)
            kwargs["cache"] = cache
        if cache is None:
            return forward(*args, **kwargs)
        install(cache, window=session.policy.window, track_attention=session.policy.needs_accumulated_attention)
        session.cache = cache
        layers = sieve_layers(cache)
        for _, layer in layers:  # decode mode: a segment grows by at most evict_every between evictions
            layer.spare = session.evict_every if session.mode == "decode" else None
        fresh = all(layer.seen == 0 for _, layer in layers)
        q_len = inputs.shape[1]
        if fresh:
            session.report = CompressionReport()
        if session.mode == "prefill":
            if fresh and q_len <= session.protected_tail:
                raise ValueError(
                    f"the prompt ({q_len} tokens) is not longer than protected_tail={session.protected_tail}"
                )
            if fresh and session.policy.evicts and session.policy.uses_window and q_len < session.policy.window:
                raise ValueError(
                    f"window {session.policy.window} is larger than the context ({q_len} tokens); use a smaller window"
                )
            output = forward(*args, **kwargs)
            session.peak_cache_bytes = max(session.peak_cache_bytes, cache_bytes(cache))
            if fresh and session.policy.evicts and session.recall is not None:
                # the caller's cache becomes a copy of the hot tier, armed for the next forward's recall
                session.tiers = TieredContext.split(model, cache, input_ids, session.policy, session.budget.ratio,
                                                    session.recall, session.protected_tail)
                cache.layers = session.tiers.question_cache().layers
                session.report = session.tiers.report
            elif fresh and session.policy.evicts:  # KVzip: one more forward, repeating input_ids
                prune_prompt(model, cache, input_ids, session.policy, session.budget, session.protected_tail,
                             session.report)
            return output
        if fresh:
            # a kept count may exceed the prompt: nothing is evicted until the cache grows past it
            budget = session.budget
            context = session.context_tokens or q_len
            session.budget_tokens = budget.kept if budget.kept is not None else budget.resolve(context)
            selection = session.policy.selection
            # every layer keeps its sinks, window and the latest chunk; PyramidKV varies the rest by depth
            floor = selection.sink + max(selection.recent, session.chunk_size)
            session.layer_budgets = selection.layer_budgets_for(session.budget_tokens, None, len(cache.layers), floor)
        for idx, layer in layers:  # what each layer is evicted back to, with the layer (a server's row cap reads it)
            layer.budget = session.layer_budgets[idx]
        return _forward_in_chunks(forward, args, kwargs, input_ids is not None, q_len, session, layers)

    wrapped.kvsieve_unwrapped = forward
    return wrapped


def _forward_in_chunks(forward, args, kwargs, by_ids: bool, q_len: int, session: Session, layers) -> object:
    key = "input_ids" if by_ids else "inputs_embeds"
    if key in kwargs:
        full = kwargs.pop(key)
    else:  # given positionally: the first argument
        full, args = args[0], args[1:]
    kwargs.pop("attention_mask", None)  # checked unpadded above; masks are rebuilt per layer
    positions = kwargs.pop("position_ids", None)
    outputs, logits = None, []
    for start in range(0, q_len, session.chunk_size):
        stop = min(q_len, start + session.chunk_size)
        chunk_kwargs = dict(kwargs, **{key: full[:, start:stop]})
        if positions is not None:
            chunk_kwargs["position_ids"] = positions[:, start:stop]
        outputs = forward(*args, **chunk_kwargs)
        if session.cache is not None:
            session.peak_cache_bytes = max(session.peak_cache_bytes, cache_bytes(session.cache))
        if getattr(outputs, "logits", None) is not None:
            logits.append(outputs.logits)
        read = stop - start
        # a prompt chunk is evicted at once; generated tokens (one-token forwards) every evict_every of them
        if q_len == 1 and not session.reading:
            session.pending += 1
            if session.pending < session.evict_every:
                continue
        over = any(layer_occupancy(layer) > session.layer_budgets[idx] for idx, layer in layers)
        if session.policy.evicts and over:
            # the chunk just read (e.g. the question) stays until the next compression: it is not answered yet
            report = CompressionReport(seconds=session.report.seconds, events=session.report.events)
            session.report = compress_cache(session.cache, session.policy, protected_tail=read,
                                            report=report, layer_budgets=session.layer_budgets)
        session.pending = 0
    if len(logits) > 1 and not kwargs.get("logits_to_keep"):  # all positions asked for: stitch the chunks
        outputs.logits = torch.cat(logits, dim=1)
    return outputs
