"""KVzip's context reconstruction: score every cached entry by the attention the model pays it while
repeating the context, then prune the cache with those scores.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv:2505.23416
(the policy and its formula: :mod:`kvsieve.policies.kvzip`).

After the prefill, the context is cut into chunks of ``chunk_size`` tokens (the paper's m = 2K). Chunk
t is forwarded on top of the full context cache as

    first chunk:  "\\n\\nRepeat the previous context exactly." + postfix + c_1
    later chunks: "\\n\\nRepeat the part of the previous context exactly, starting with"
                  + the last 8 tokens of c_{t-1} + postfix + c_t

where ``postfix`` closes the user turn and opens the assistant turn of the chat template (``"\\n"``
without a template). These are the strings of the authors' implementation (github.com/snu-mllab/KVzip,
``model/wrapper.py``); the paper's Algorithm 1 abbreviates them as "Repeat the previous context:" and
"Repeat the previous context starting with <8 tokens>:". Every chunk runs on a shallow copy of the
cache, so its reconstruction tokens never reach the cache that is pruned. The chat template's header
(system prompt, user-turn opener) is not repeated and is always kept, as in the authors' code, which
leaves the system prompt outside the eviction range.

While a chunk runs, the attention function registered here (``kvsieve_kvzip``) records, per layer,
KV head and cached entry, the largest softmax weight any reconstruction query of the group's query
heads gives that entry, in blocks of ``QUERY_BLOCK`` queries (memory: one (block, keys) matrix per
query head), then hands the call to transformers' sdpa. Two normalisations:

* ``"chunk"`` (the paper's Algorithm 1, default): the softmax runs over the header's keys, the keys of
  the chunk being repeated and the reconstruction tokens' own keys (causal); chunk t scores only the
  entries of c_t.
* ``"full"``: the softmax runs over the whole cache plus the reconstruction tokens (what the forward
  pass computes); every chunk's queries score every entry, maxed over all chunks.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvsieve.engine.attention import bottom_right_causal_mask
from kvsieve.engine.cache import SieveLayer, sieve_layers
from kvsieve.engine.compress import CompressionReport, LayerReport, checked_scores, layer_signals
from kvsieve.engine.modules import attention_modules
from kvsieve.selection import Budget

__all__ = [
    "ATTENTION_NAME", "FIRST_PROMPT", "NEXT_PROMPT", "OVERLAP", "QUERY_BLOCK", "ReconstructionPrompt",
    "ReconstructionChunk", "Reconstruction", "reconstruction_chunks", "reconstruction_scores",
    "compress_with_reconstruction", "reconstruction_prompt",
]

ATTENTION_NAME = "kvsieve_kvzip"
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # trailing tokens of the previous chunk quoted in a later chunk's instruction
QUERY_BLOCK = 512  # reconstruction queries per block when taking the max attention


@dataclass(frozen=True)
class ReconstructionPrompt:
    """Token ids of the reconstruction instruction, and of the chat template around it.

    ``header``: the template's tokens before the user content (kept, never repeated);
    ``postfix``: what closes the user turn and opens the assistant's (before the repeated chunk).
    """

    first: tuple[int, ...]
    next: tuple[int, ...]
    postfix: tuple[int, ...]
    header: tuple[int, ...] = ()

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ReconstructionPrompt:
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()

        header, postfix = "", "\n"
        if getattr(tokenizer, "chat_template", None):
            marker = "\x1fKVZIP-CONTENT\x1f"
            text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                                 add_generation_prompt=True)
            header, postfix = text.split(marker, 1)
        return cls(ids(FIRST_PROMPT), ids(NEXT_PROMPT), ids(postfix), ids(header))

    def header_length(self, input_ids: torch.Tensor) -> int:
        """Leading tokens of ``input_ids`` (every row) equal to the template header's tokens."""
        header = torch.tensor(self.header, dtype=input_ids.dtype, device=input_ids.device)
        size = min(len(self.header), input_ids.shape[1])
        same = (input_ids[:, :size] == header[:size]).all(dim=0)
        return int(same.long().cumprod(0).sum()) if size else 0


@dataclass(frozen=True)
class ReconstructionChunk:
    start: int  # cache positions [start, end) of the context tokens this chunk repeats
    end: int
    input_ids: torch.Tensor  # (b, n_in): instruction + postfix + the repeated tokens


def reconstruction_chunks(input_ids: torch.Tensor, prompt: ReconstructionPrompt, header: int, context_end: int,
                          chunk_size: int = 2048, overlap: int = OVERLAP) -> list[ReconstructionChunk]:
    """Cut ``input_ids[:, header:context_end]`` into chunks and prepend each chunk's instruction."""
    if not 0 <= header < context_end <= input_ids.shape[1]:
        raise ValueError(f"nothing to reconstruct: header {header}, context end {context_end}, "
                         f"{input_ids.shape[1]} cached tokens")
    b = input_ids.shape[0]

    def ids(values: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor([values], dtype=input_ids.dtype, device=input_ids.device).expand(b, -1)

    chunks = []
    for start in range(header, context_end, chunk_size):
        end = min(context_end, start + chunk_size)
        if start == header:
            instruction = ids(prompt.first)
        else:
            instruction = torch.cat([ids(prompt.next), input_ids[:, max(header, start - overlap) : start]], dim=1)
        chunks.append(ReconstructionChunk(start, end, torch.cat([instruction, ids(prompt.postfix),
                                                                 input_ids[:, start:end]], dim=1)))
    return chunks


@dataclass
class Reconstruction:
    """Per compressed layer, (b, kv_heads, n) float32 max attention from the reconstruction queries."""

    scores: dict[int, torch.Tensor]
    header: int  # leading entries not scored by ``"chunk"`` and always kept
    seconds: float
    chunks: int
    tokens: int  # reconstruction tokens forwarded in all


@dataclass
class _State:
    cached: int  # entries in the cache before the reconstruction tokens
    header: int
    start: int
    end: int
    normalization: str
    scores: dict[int, torch.Tensor] = field(default_factory=dict)


def kvzip_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """sdpa with a bottom-right causal mask; records KVzip's max attention on the compressed layers."""
    q_len, k_len = query.shape[2], key.shape[2]
    mask = bottom_right_causal_mask(q_len, k_len, query.device, getattr(module, "sliding_window", None))[None, None]
    state = getattr(module, "_kvsieve_kvzip", None)
    if state is not None and module.layer_idx in state.scores:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        _record_max_attention(state, state.scores[module.layer_idx], query, key, scale)
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _record_max_attention(state: _State, best: torch.Tensor, query, key, scaling: float) -> None:
    """Running max into ``best`` (b, h, n) of the float32 softmax weights, one block of queries at a time."""
    b, hq, q_len, d = query.shape
    h, k_len = key.shape[1], key.shape[2]
    groups, n = hq // h, state.cached
    if k_len != n + q_len:
        raise RuntimeError(f"reconstruction expected {n} cached + {q_len} new keys, got {k_len}")
    if state.normalization == "full":
        keys, prefix, lo, hi = key, n, 0, n
    else:  # header + the repeated chunk + the reconstruction tokens
        keys = torch.cat([key[:, :, : state.header], key[:, :, state.start : state.end], key[:, :, n:]], dim=2)
        prefix, lo, hi = state.header + state.end - state.start, state.header, state.header + state.end - state.start
    keys = keys.float().transpose(-1, -2)  # (b, h, d, keys): float32 logits, no bf16 rounding of the scores
    grouped = query.reshape(b, h, groups, q_len, d)  # the query heads sharing a KV head, side by side
    target = best if state.normalization == "full" else best[..., state.start : state.end]
    for start in range(0, q_len, QUERY_BLOCK):
        stop = min(q_len, start + QUERY_BLOCK)
        visible = prefix + stop  # later reconstruction tokens are in every query's future
        # out of place: in float32 .float() returns the query itself, and an in-place scale would reach
        # the forward's own attention (scaled twice: KVzip's float32 scores and reconstruction were wrong)
        block = (grouped[:, :, :, start:stop].float() * scaling).reshape(b, h, groups * (stop - start), d)
        logits = torch.matmul(block, keys[..., :visible])  # (b, h, g * block, visible)
        at = torch.arange(stop, device=query.device)
        future = at[None, :] > at[start:, None]  # a reconstruction key after the query
        logits.view(b, h, groups, stop - start, visible)[..., prefix:].masked_fill_(future, float("-inf"))
        weights = torch.softmax(logits, dim=-1)[..., lo:hi]
        target.copy_(torch.maximum(target, weights.amax(dim=2)))


AttentionInterface.register(ATTENTION_NAME, kvzip_attention)


def _shallow_copy(cache: DynamicCache) -> DynamicCache:
    """Appending makes new tensors, so a copy of the layer objects keeps ``cache`` untouched."""
    clone = copy.copy(cache)
    clone.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in clone.layers:
        if isinstance(layer, SieveLayer):
            layer.track_attention, layer.attention_received = False, None
            layer.grow_in_place = False  # kvzip_attention wants every key back from update()
    return clone


@torch.no_grad()
def reconstruction_scores(model, cache: DynamicCache, input_ids: torch.Tensor, prompt: ReconstructionPrompt,
                          protected_tail: int = 0, chunk_size: int = 2048, normalization: str = "chunk",
                          header: int | None = None) -> Reconstruction:
    """Run the chunked reconstruction on copies of ``cache`` (left as it is) and return the scores.

    ``input_ids`` (b, n) are the tokens ``cache`` holds (every full-attention layer unpruned); the last
    ``protected_tail`` of them (a question) are not repeated. ``header`` defaults to the number of
    leading tokens equal to the chat template's header.
    """
    if normalization not in ("chunk", "full"):
        raise ValueError(f"normalization {normalization!r} is not one of 'chunk', 'full'")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    layers = sieve_layers(cache)
    n = input_ids.shape[1]
    for idx, layer in layers:
        if layer.physical_length != n or layer.seen != n or layer.valid is not None:
            raise ValueError(
                f"KVzip reconstructs from the whole context cache: layer {idx} holds {layer.physical_length} of "
                f"{layer.seen} entries for {n} input tokens (already pruned, or ids that are not the cache's)"
            )
    start_time = time.perf_counter()
    header = prompt.header_length(input_ids) if header is None else header
    chunks = reconstruction_chunks(input_ids, prompt, header, n - protected_tail, chunk_size)
    b = input_ids.shape[0]
    state = _State(n, header, 0, 0, normalization, {
        idx: torch.zeros(b, layer.keys.shape[1], n, dtype=torch.float32, device=layer.keys.device)
        for idx, layer in layers
    })
    modules = attention_modules(model)
    configs = {id(c): c for c in [model.config, *(getattr(m, "config", None) for m in modules)] if c is not None}
    saved = {key: c._attn_implementation for key, c in configs.items()}
    forward = type(model).forward  # the class's forward: bypasses kvsieve.attach's wrapper, if any
    try:
        for config in configs.values():
            config._attn_implementation = ATTENTION_NAME
        for module in modules:
            module._kvsieve_kvzip = state
        for chunk in chunks:
            state.start, state.end = chunk.start, chunk.end
            forward(model, input_ids=chunk.input_ids, cache=_shallow_copy(cache), use_cache=True, logits_to_keep=1)
    finally:
        for module in modules:
            module.__dict__.pop("_kvsieve_kvzip", None)
        for key, config in configs.items():
            config._attn_implementation = saved[key]
    tokens = sum(c.input_ids.shape[1] for c in chunks)
    return Reconstruction(state.scores, header, time.perf_counter() - start_time, len(chunks), tokens)


def reconstruction_prompt(policy, model) -> ReconstructionPrompt:
    """The reconstruction prompt of ``policy``'s tokenizer (loaded from the model's folder when the policy has none)."""
    tokenizer = getattr(policy, "tokenizer", None)
    if tokenizer is None:
        from transformers import AutoTokenizer

        source = getattr(model.config, "name_or_path", "") or getattr(model, "name_or_path", "")
        needed = (f"policy {policy.name!r} prompts the model to repeat the context and needs its tokenizer: "
                  f"kvsieve.policies.get({policy.name!r}, tokenizer=tokenizer)")
        if not source:
            raise ValueError(f"{needed} (the model names no folder to load it from)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as err:  # noqa: BLE001 - any failure means: no tokenizer to be found
            raise ValueError(f"{needed} (none found at {source!r}: {err})") from err
        policy.tokenizer = tokenizer
    return ReconstructionPrompt.from_tokenizer(tokenizer)


@torch.no_grad()
def compress_with_reconstruction(model, cache: DynamicCache, input_ids: torch.Tensor, policy, budget: Budget,
                                 protected_tail: int = 0, report: CompressionReport | None = None,
                                 reconstruction: Reconstruction | None = None) -> CompressionReport:
    """Prune ``cache`` in place with a policy whose scores come from a reconstruction (``needs_reconstruction``).

    Runs the reconstruction unless ``reconstruction`` (computed on this same cache) is given; its time
    counts in ``report.seconds``. Allocation: ``policy.allocation == "uniform"`` uses the policy's
    :class:`~kvsieve.selection.Selection` per layer, like every other policy; ``"global"`` lets
    ``policy.global_kept_indices`` pick the entries of all layers and heads at once.
    """
    report = report if report is not None else CompressionReport()
    start = time.perf_counter()
    # computed outside (the grid shares one per sample): still part of this compression's cost
    earlier = reconstruction.seconds if reconstruction is not None else 0.0
    layers = sieve_layers(cache)
    num_layers = len(cache.layers)
    n = max((layer.physical_length for _, layer in layers), default=0)
    context = n - protected_tail
    kept = budget.resolve(context)
    chosen: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    if layers and kept < context:
        if reconstruction is None:
            prompt = reconstruction_prompt(policy, model)
            reconstruction = reconstruction_scores(model, cache, input_ids, prompt, protected_tail,
                                                   policy.chunk_size, policy.normalization)
        if reconstruction.header > kept:
            raise ValueError(f"budget of {kept} entries is below the {reconstruction.header} chat-template header "
                             "tokens KVzip always keeps; raise the budget")
        scores = {}
        for idx, layer in layers:
            signals = layer_signals(layer, idx, num_layers, protected_tail, policy.window)
            signals.extra["reconstruction"] = reconstruction.scores[idx]
            signals.extra["reconstruction_header"] = reconstruction.header
            scores[idx] = checked_scores(policy, signals, layer.valid)
        if policy.allocation == "global":
            picked = policy.global_kept_indices([scores[idx] for idx, _ in layers], kept, protected_tail)
            chosen = {idx: pick for (idx, _), pick in zip(layers, picked)}
        else:
            budgets = policy.selection.layer_budgets_for(kept, context, num_layers)
            for idx, _ in layers:
                if budgets[idx] < context:
                    chosen[idx] = policy.selection.kept_indices(scores[idx], budgets[idx] + protected_tail,
                                                                protected_tail)
    for idx, layer in layers:
        before, tokens_before = layer.nbytes(), layer.physical_length
        if idx in chosen:
            layer.prune(*chosen[idx])
        valid = layer.valid
        valid_mean = float(valid.float().sum(-1).mean()) if valid is not None else float(layer.physical_length)
        report.layers.append(LayerReport(idx, tokens_before, layer.physical_length, before, layer.nbytes(),
                                         valid_mean))
    report.seconds += time.perf_counter() - start + earlier
    report.events += 1
    return report
