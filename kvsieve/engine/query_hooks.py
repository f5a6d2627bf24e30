"""Pre-RoPE query statistics, for policies that model the distribution of future queries.

Expected Attention (Devoto et al., arXiv:2510.00636) scores a key by the attention that queries not
yet seen should pay it, modelling those queries as Gaussian with the mean and covariance of the
queries the layer has computed so far, *before* the rotary embedding (the rotation of a future
position is applied to these statistics afterwards). The attention function only ever sees rotated
queries, so this module hooks the query projection of every attention layer (the output of
``q_proj``, passed through the layer's ``q_norm`` where the model normalises its queries, e.g. Qwen3
and Gemma3) and keeps, on each :class:`~kvsieve.engine.cache.SieveLayer`, a :class:`~kvsieve.query_stats.QueryStats` per
batch row and query head.

The hooks are installed only while a policy with ``needs_query_stats`` is attached
(:func:`query_stats_hooks`, called by ``kvsieve.attach``) and removed on exit, also on error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch

from kvsieve.engine.cache import SieveLayer
from kvsieve.engine.modules import attention_modules
from kvsieve.query_stats import QueryStats

__all__ = ["query_stats_hooks", "rope_of"]

def rope_of(rotary, attention) -> tuple[torch.Tensor | None, float]:
    """(inv_freq, attention_scaling) of the rotary embedding ``attention`` uses (Gemma3: per layer type)."""
    if rotary is None:
        return None, 1.0
    if hasattr(rotary, "inv_freq"):
        return rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))
    layer_type = getattr(attention, "layer_type", None)
    if layer_type is None:
        layer_type = attention.config.layer_types[attention.layer_idx]
    return getattr(rotary, f"{layer_type}_inv_freq"), float(getattr(rotary, f"{layer_type}_attention_scaling", 1.0))


def _rotary_module(model):
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            return module
    return None


def _bind(attention, args, kwargs) -> None:
    """Before an attention layer runs: remember which cache layer this forward writes to."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers = getattr(cache, "layers", None)
    layer = layers[attention.layer_idx] if layers is not None and attention.layer_idx < len(layers) else None
    attention._kvsieve_query_layer = layer if isinstance(layer, SieveLayer) else None


def _unbind(attention, args, output) -> None:
    attention.__dict__.pop("_kvsieve_query_layer", None)


@torch.no_grad()
def _record(attention, rotary, module, args, output) -> None:
    """After the query projection: add the pre-RoPE (and post-``q_norm``) queries to the layer's statistics."""
    layer = attention.__dict__.get("_kvsieve_query_layer")
    if layer is None:
        return
    queries = output.view(*output.shape[:2], -1, attention.head_dim)  # (b, q, hq, d)
    norm = getattr(attention, "q_norm", None)
    if isinstance(norm, torch.nn.Module):  # Qwen3, Gemma3: the rotary embedding rotates normalised queries
        queries = norm(queries)  # an RMSNorm over head_dim: the same whichever axis order the model uses
    queries = queries.transpose(1, 2)  # (b, hq, q, d)
    stats, start = layer.query_stats, layer.seen  # the cache is updated after the projections
    if stats is None:
        if start != 0:  # statistics must cover the layer from its first token, else none at all
            return
        stats = QueryStats.empty(queries.shape[0], queries.shape[1], queries.shape[3], queries.device)
    elif stats.batch_size != queries.shape[0] or stats.total != start:
        # rows assembled from other caches (the runner's decode batches): these statistics no longer
        # describe this cache; dropping them makes a later compression with them fail loudly
        layer.query_stats = None
        return
    layer.query_stats = stats.add(queries, start)
    layer.rope = rope_of(rotary, attention)


@contextlib.contextmanager
def query_stats_hooks(model, session) -> Iterator[None]:
    """Collect pre-RoPE query statistics while ``session.policy.needs_query_stats``; a no-op otherwise.

    The hooks are removed when the block exits, also on error.
    """
    if not getattr(session.policy, "needs_query_stats", False) or model.__dict__.get("_kvsieve_query_hooks"):
        yield  # nothing asked, or an outer attach's hooks already record (twice would double-count)
        return
    model.__dict__["_kvsieve_query_hooks"] = True
    rotary = _rotary_module(model)
    attentions = attention_modules(model)
    handles = []
    try:
        for attention in attentions:
            handles.append(attention.register_forward_pre_hook(_bind, with_kwargs=True))
            handles.append(attention.q_proj.register_forward_hook(partial(_record, attention, rotary)))
            handles.append(attention.register_forward_hook(_unbind))
        yield
    finally:
        model.__dict__.pop("_kvsieve_query_hooks", None)
        for handle in handles:
            handle.remove()
        for attention in attentions:
            attention.__dict__.pop("_kvsieve_query_layer", None)
