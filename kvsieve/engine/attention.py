"""The attention function kvsieve registers with transformers while a policy is attached.

Transformers builds one mask per forward from the cache's logical length; after pruning, layers
hold fewer (and possibly different numbers of) entries. This function therefore builds its own
mask from the physical key length of each layer: every cached entry precedes the new queries, so
the causal mask is aligned to the bottom-right. It also records what policies need: the last
queries of each layer and, on request, the attention every entry receives.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvsieve.engine.cache import SieveLayer

__all__ = ["ATTENTION_NAME", "sieve_attention", "bottom_right_causal_mask"]

ATTENTION_NAME = "kvsieve_sdpa"
_QUERY_BLOCK = 512  # queries per block when accumulating attention, bounds the (q, k) buffer


def bottom_right_causal_mask(q_len: int, k_len: int, device, sliding_window: int | None = None) -> torch.Tensor:
    """(q, k) bool: query i sees key j iff j <= k - q + i (and within the sliding window)."""
    query_at = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    key_at = torch.arange(k_len, device=device)[None, :]
    allowed = key_at <= query_at
    if sliding_window is not None:
        allowed &= (query_at - key_at) < sliding_window
    return allowed


def sieve_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    session = getattr(module, "_kvsieve_session", None)
    layer = session.layer(module.layer_idx) if session is not None else None
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
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


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
