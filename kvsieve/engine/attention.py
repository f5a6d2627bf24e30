"""The attention function kvsieve registers with transformers while a policy is attached.

Transformers builds one mask per forward from the cache's logical length; after pruning, layers
hold fewer (and possibly different numbers of) entries. This function therefore builds its own
mask from the physical key length of each layer: every cached entry precedes the new queries, so
the causal mask is aligned to the bottom-right. It also records what policies need: the last
queries of each layer and, on request, the attention every entry receives.
"""

from __future__ import annotations

import inspect
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvsieve.engine.cache import SieveLayer

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10 has no varlen attention: the padded path serves every device
    varlen_attn = None

__all__ = ["ATTENTION_NAME", "sieve_attention", "bottom_right_causal_mask", "blocked_causal_attention",
           "use_blocked_prefill", "stored_attention"]

ATTENTION_NAME = "kvsieve_sdpa"
_QUERY_BLOCK = 512  # queries per block when accumulating attention, bounds the (q, k) buffer
# Multi-query CPU forwards in these dtypes may take blocked_causal_attention instead of torch's CPU kernel:
# in bf16 it ran 2-3x the kernel's GFLOP/s, in float32 no faster (docs/performance.md#blocked-prefill).
BLOCKED_PREFILL_DTYPES: set[torch.dtype] = {torch.bfloat16}
# "auto" (default): blocked where OpenMP threads do not spin-wait (OMP_WAIT_POLICY=PASSIVE, or one thread),
# where spinning made it 1.4-8x slower; "1": always; "0": never. Never decided by load, so results do not
# change with what else runs (the two paths round bf16 differently).
BLOCKED_PREFILL = os.environ.get("KVSIEVE_BLOCKED_PREFILL", "auto")
_OMP_SPINS = not (os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
                  or os.environ.get("GOMP_SPINCOUNT", "").strip() == "0")  # libgomp reads them at start-up


def use_blocked_prefill(dtype: torch.dtype) -> bool:
    """Whether a multi-query forward in ``dtype`` on the CPU takes :func:`blocked_causal_attention`."""
    if BLOCKED_PREFILL == "0" or dtype not in BLOCKED_PREFILL_DTYPES:
        return False
    return BLOCKED_PREFILL != "auto" or not _OMP_SPINS or torch.get_num_threads() == 1


_PREFILL_BLOCK = 64  # query rows per block: fastest of 32-256 at 1k-8k tokens; larger blocks leave the cache


def bottom_right_causal_mask(q_len: int, k_len: int, device, sliding_window: int | None = None) -> torch.Tensor:
    """(q, k) bool: query i sees key j iff j <= k - q + i (and within the sliding window)."""
    query_at = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    key_at = torch.arange(k_len, device=device)[None, :]
    allowed = key_at <= query_at
    if sliding_window is not None:
        allowed &= (query_at - key_at) < sliding_window
    return allowed


_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _workers(count: int) -> ThreadPoolExecutor:
    """A pool of ``count`` threads whose torch ops run single-threaded (one per pid: fork-safe)."""
    key = (os.getpid(), count)
    if key not in _pools:
        def single_threaded():
            torch.get_num_threads()  # torch's per-thread lazy init first, so it cannot undo the next line
            torch.set_num_threads(1)

        ready = threading.Barrier(count + 1)
        pool = ThreadPoolExecutor(count, thread_name_prefix="kvsieve-attention", initializer=single_threaded)
        for _ in range(count):
            pool.submit(ready.wait)
        ready.wait()  # every worker has started and set its thread count
        torch.set_num_threads(count)  # the workers' set_num_threads also set the default of new threads
        _pools[key] = pool
    return _pools[key]


def blocked_causal_attention(query, key, value, scaling: float | None = None, valid=None,
                             block: int = _PREFILL_BLOCK) -> torch.Tensor:
    """Causal attention of ``query`` over ``key``/``value`` by matrix products, as sdpa would compute it.

    ``query`` (b, hq, q, d), ``key``/``value`` (b, h, k, d) with ``k >= q``: the mask is causal and
    aligned bottom-right (every key before the last ``q`` is visible to all queries); ``valid``
    (b, h, k) bool hides entries per kv head (AdaKV). Returns (b, q, hq, d), the layout of
    ``sdpa_attention_forward``. Blocks of ``block`` queries multiply only the keys they can see;
    the ``hq / h`` query heads of a kv head are stacked into one matrix (no repeated keys). With
    ``torch.get_num_threads()`` > 1 the blocks are dealt out to as many single-threaded workers.

    Numerics: the products accumulate in float32 but return the input dtype, so in bf16 each logit is
    rounded relative to its own size (Qwen2.5's first layers reach logits of several hundred). The
    softmax does not change if every logit of a row moves by the same amount, so each row is first
    shifted by its logit on the first key (the attention sink, usually the row's largest) inside the
    product, through one extra column (queries carry ``-shift``, keys carry 1); the logits near the
    top are then small and rounded finely. The softmax of bf16 on the CPU accumulates in float32.
    """
    b, hq, q_len, d = query.shape
    h, k_len = key.shape[1], key.shape[2]
    groups = hq // h
    width = d + 16  # the shift column and 15 zero columns (keeps a head dim of 64 or 128 a multiple of 16)
    grouped = query.new_zeros(b, h, q_len, groups, width)  # query-major: a block of queries is one matrix
    scaled = query * (scaling if scaling is not None else d**-0.5)
    grouped[..., :d] = scaled.view(b, h, groups, q_len, d).transpose(2, 3)
    grouped[..., d:d + 1] = -torch.matmul(grouped[..., :d].float(), key[:, :, None, :1].float().transpose(-1, -2))
    keys_t = key.new_zeros(b, h, width, k_len)  # stored transposed: bmm copies a transposed view's slice slowly
    keys_t[:, :, :d] = key.transpose(-1, -2)
    keys_t[:, :, d] = 1
    hidden = ~valid[:, :, None, None, :] if valid is not None else None
    future = torch.ones(block, block, dtype=torch.bool, device=query.device).triu_(1)[:, None, :]
    grad = torch.is_grad_enabled()

    def run(starts: list[int]) -> list[torch.Tensor]:
        outs = []
        with torch.set_grad_enabled(grad):  # grad mode is per thread
            for start in starts:
                stop = min(q_len, start + block)
                rows, visible = stop - start, k_len - q_len + stop  # later keys are in every query's future
                logits = torch.matmul(grouped[:, :, start:stop].view(b, h, rows * groups, width), keys_t[..., :visible])
                logits = logits.view(b, h, rows, groups, visible)
                logits[..., visible - rows:].masked_fill_(future[:rows, :, :rows], float("-inf"))
                if hidden is not None:
                    logits.masked_fill_(hidden[..., :visible], float("-inf"))
                probs = torch.softmax(logits, dim=-1).view(b, h, rows * groups, visible)
                outs.append(torch.matmul(probs, value[:, :, :visible]))
        return outs

    starts = list(range(0, q_len, block))
    count = min(torch.get_num_threads(), len(starts))
    if count > 1 and threading.current_thread().name.startswith("kvsieve-attention"):
        count = 1  # already inside a worker
    if count > 1:  # worker i takes blocks i, i + count, ...: shares of nearly equal cost
        shares = list(_workers(count).map(run, [starts[i::count] for i in range(count)]))
        blocks = [shares[i % count][i // count] for i in range(len(starts))]
    else:
        blocks = run(starts)
    out = torch.cat(blocks, dim=2).view(b, h, q_len, groups, value.shape[-1])
    return out.transpose(1, 2).reshape(b, q_len, hq, value.shape[-1]).contiguous()


def sieve_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    session = getattr(module, "_kvsieve_session", None)
    layer = session.layer(module.layer_idx) if session is not None else None
    if isinstance(layer, SieveLayer) and layer.recall is not None:  # a question recalling evicted entries
        recall, layer.recall = layer.recall, None
        recall(layer, query)
        if layer.store is None:
            key, value = layer.keys, layer.values
    if isinstance(layer, SieveLayer) and layer.store is not None:
        layer.scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        layer.remember_queries(query)
        session.observe(layer.physical_length)
        return stored_attention(query, layer, layer.scaling), None
    q_len, k_len = query.shape[2], key.shape[2]
    sliding = getattr(module, "sliding_window", None)
    valid = layer.valid if isinstance(layer, SieveLayer) else None
    needs_window_mask = sliding is not None and k_len > sliding
    mask = None
    if (q_len > 1 and q_len != k_len) or valid is not None or needs_window_mask:
        mask = bottom_right_causal_mask(q_len, k_len, query.device, sliding)[None, None]
        if valid is not None:
            groups = query.shape[1] // key.shape[1]
            mask = mask & valid.repeat_interleave(groups, dim=1)[:, :, None, :]
    if isinstance(layer, SieveLayer):
        layer.scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        layer.remember_queries(query)
        if layer.track_attention:
            _accumulate_attention(layer, query, key, mask, layer.scaling)
        session.observe(k_len)
    kwargs.pop("is_causal", None)
    if (q_len > 1 and query.device.type == "cpu" and use_blocked_prefill(query.dtype) and not needs_window_mask
            and getattr(module, "is_causal", True) and (dropout == 0.0 or not module.training)):
        return blocked_causal_attention(query, key, value, scaling, valid), None
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


# varlen_attn and whether it takes seqused_k and enable_gqa (torch 2.13; the lent GPU's torch 2.11 takes neither
# and does GQA by head counts)
_VARLEN = None if varlen_attn is None else (
    varlen_attn, "seqused_k" in inspect.signature(varlen_attn).parameters,
    "enable_gqa" in inspect.signature(varlen_attn).parameters)
_varlen_failed: list[str] = []  # the first error of the varlen path on this process (then the padded path)


def stored_attention(query: torch.Tensor, layer: SieveLayer, scaling: float) -> torch.Tensor:
    """Attention of ``query`` (b, hq, q, d) over a stored layer: each (row, KV head) against exactly its own entries.

    The calls per layer never grow with the number of heads. The layer already holds the new tokens (``update``
    appended them), so the causal mask is bottom-right per segment. On CUDA, one ``varlen_attn`` call with every
    segment a sequence of its own (its ``hq / h`` query heads its heads); elsewhere one sdpa call per capacity
    bucket of the store (at most :data:`~kvsieve.engine.ragged.BUCKETS`, one for a full or uniform cache) over a
    view of the buffer, each segment masked past its length. The ``hq / h`` query heads of a KV head are stacked
    as rows of one query matrix, so keys are never repeated. With attention tracking on, the softmax is computed
    explicitly and its column sums added to the entries' ``attention``. Returns (b, q, hq, d).
    """
    store = layer.store
    b, hq, q_len, d = query.shape
    h = store.heads
    groups = hq // h
    if (query.is_cuda and _VARLEN is not None and not layer.track_attention and not _varlen_failed
            and query.dtype in (torch.float16, torch.bfloat16)):
        try:
            return _varlen_attention(query, store, scaling)
        except RuntimeError as err:  # an old kernel, an unsupported head dim: the bucket path still answers
            _varlen_failed.append(str(err))
            warnings.warn(f"kvsieve: varlen attention failed ({err}); using sdpa per bucket", stacklevel=2)
    if layer.track_attention:
        store = layer.store = store.writable()  # its attention is added to in place
    rows = query.view(b, h, groups, q_len, d).reshape(b * h, groups * q_len, d)
    only = len(store.buckets) == 1 and store.uniform
    out = None if only else rows.new_empty(b * h, groups * q_len, store.values.shape[-1])
    for bucket, width, even in zip(store.buckets, store.bucket_widths, store.bucket_even):
        keys, values = bucket.view(store.keys)[:, :width], bucket.view(store.values)[:, :width]
        q = rows if only else rows[bucket.device_segments]
        mask = None
        if q_len > 1 or not even:
            key_at = torch.arange(width, device=query.device)
            seg_lengths = store.device_lengths[bucket.device_segments].view(-1, 1, 1, 1)
            if q_len > 1:  # entry j of a segment is seen by its query t iff j <= length - q + t (so j < length)
                mask = key_at <= seg_lengths - q_len + torch.arange(q_len, device=query.device)[:, None]  # (n,1,q,w)
            else:
                mask = key_at < seg_lengths  # (n, 1, 1, w)
        if mask is not None:
            mask = mask.expand(-1, groups, q_len, width).reshape(-1, groups * q_len, width)
        if layer.track_attention:
            logits = torch.matmul(q * scaling, keys.transpose(-1, -2)).float()
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            bucket.view(store.attention)[:, :width] += probs.sum(dim=1)
            part = torch.matmul(probs.to(values.dtype), values)
        else:
            part = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
        if only:
            out = part
        else:
            out.index_copy_(0, bucket.device_segments, part)
    out = out.view(b, h, groups, q_len, -1).reshape(b, hq, q_len, -1)
    return out.transpose(1, 2).contiguous()


def _varlen_attention(query: torch.Tensor, store, scaling: float, varlen: tuple | None = None) -> torch.Tensor:
    """``varlen_attn`` over the store's segments in buffer order; each segment is a sequence whose ``hq / h`` query
    heads share its one KV head. Without ``seqused_k`` (torch < 2.13) each segment's spare room is passed as a
    sequence of its own with no queries. ``varlen``: (kernel, takes seqused_k, takes enable_gqa), default torch's."""
    varlen_attn, has_seqused, has_gqa_flag = varlen or _VARLEN
    b, hq, q_len, d = query.shape
    h = store.heads
    groups, segments = hq // h, b * h
    device = query.device
    order = torch.cat([bucket.device_segments for bucket in store.buckets])  # buffer order
    packed = query.view(b, h, groups, q_len, d).permute(0, 1, 3, 2, 4).reshape(segments, q_len, groups, d)
    packed = packed[order].reshape(segments * q_len, groups, d)
    keys, values = store.keys[:, None], store.values[:, None]
    lengths = store.device_lengths[order]
    starts = store.device_starts[order]
    options = {"scale": scaling, "window_size": (-1, 0) if q_len > 1 else (-1, -1)}
    if has_gqa_flag:
        options["enable_gqa"] = groups > 1
    max_k = store.width
    if has_seqused:
        cu_k = torch.cat([starts, starts.new_tensor([store.keys.shape[0]])]).int()
        cu_q = (torch.arange(segments + 1, device=device) * q_len).int()
        out = varlen_attn(packed, keys, values, cu_q, cu_k, q_len, max_k, seqused_k=lengths.int(), **options)
    else:
        spare = store.capacity.to(device)[order] - lengths
        sizes = torch.stack([lengths, spare], 1).reshape(-1)  # entries, then spare, of every segment
        cu_k = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).int()
        per_q = torch.tensor([q_len, 0], device=device).repeat(segments)
        cu_q = torch.cat([per_q.new_zeros(1), per_q.cumsum(0)]).int()
        max_k = max(max_k, int((store.capacity - store.lengths).max()))
        out = varlen_attn(packed, keys, values, cu_q, cu_k, q_len, max_k, **options)
    unordered = torch.empty_like(out.view(segments, q_len, groups, -1))
    unordered[order] = out.view(segments, q_len, groups, -1)
    return unordered.view(b, h, q_len, groups, -1).permute(0, 2, 1, 3, 4).reshape(b, q_len, hq, -1)


def _accumulate_attention(layer: SieveLayer, query, key, mask, scaling: float) -> None:
    """Add the softmax attention each key receives from these queries to ``layer.attention_received``.

    Query blocks only look at the keys they can see (the causal prefix), which halves the work of a
    prefill; logits are computed in the model's dtype and normalised in float32.
    """
    b, hq, q_len, d = query.shape
    h, k_len = key.shape[1], key.shape[2]
    groups = hq // h
    grouped = (query * scaling).reshape(b, h, groups, q_len, d)
    total = torch.zeros(b, h, k_len, dtype=torch.float32, device=query.device)
    for start in range(0, q_len, _QUERY_BLOCK):
        stop = min(q_len, start + _QUERY_BLOCK)
        visible = k_len - q_len + stop  # keys after this are in every query's future
        logits = torch.matmul(grouped[:, :, :, start:stop], key[:, :, None, :visible].transpose(-1, -2)).float()
        if mask is not None:
            block_mask = mask[..., start:stop, :visible]
            block_mask = block_mask.reshape(block_mask.shape[0], -1, groups, stop - start, visible) \
                if block_mask.shape[1] > 1 else block_mask[:, :, None]
        else:
            block_mask = bottom_right_causal_mask(q_len, k_len, query.device)[start:stop, :visible]
        logits = logits.masked_fill(~block_mask, float("-inf"))
        total[..., :visible] += torch.softmax(logits, dim=-1).sum(dim=(2, 3))
    layer.attention_received += total


AttentionInterface.register(ATTENTION_NAME, sieve_attention)
