"""The hidden states entering each attention layer, for policies that read the residual stream.

KVzap (Jegou et al., arXiv:2601.07891) predicts KVzip's scores from the hidden state a layer's attention
reads: the decoder layer's normed input, the tensor ``q_proj``, ``k_proj`` and ``v_proj`` are applied to.
The cache holds only its images under ``k_proj`` / ``v_proj``, so this module hooks every attention module
(a forward pre-hook: its ``hidden_states`` argument) and keeps, on the :class:`~kvsieve.engine.cache.SieveLayer`
it writes to, a (b, n, hidden) tensor of every position the layer has processed.

They are kept only while the cache holds every position in order (from the first token, nothing pruned):
a compression prunes entries per head, so ``SieveLayer.prune`` drops them, and a layer whose cache did not
start empty under the hook gets none. The hooks are installed only while a policy with
``needs_hidden_states`` is attached (:func:`hidden_states_hooks`, called by ``kvsieve.attach``) and removed
on exit, also on error. Memory: one hidden-size row per token and layer (SmolLM2-135M at 8k tokens: 0.55 GB in
float32), freed at the compression.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvsieve.engine.cache import SieveLayer
from kvsieve.engine.modules import attention_modules

__all__ = ["hidden_states_hooks"]


@torch.no_grad()
def _record(attention, args, kwargs) -> None:
    """Before an attention layer runs (its cache not yet updated): append its input to the layer's hidden states."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers = getattr(cache, "layers", None)
    if layers is None or attention.layer_idx >= len(layers) or not isinstance(layers[attention.layer_idx], SieveLayer):
        return
    layer = layers[attention.layer_idx]
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor):
        return
    held = layer.hidden_states
    if layer.seen == 0:
        layer.hidden_states = hidden.detach()
    elif held is not None and held.shape[1] == layer.seen and held.shape[0] == hidden.shape[0]:
        layer.hidden_states = torch.cat([held, hidden.detach()], dim=1)
    else:  # started before the hook, or pruned since: no longer one row per cached position
        layer.hidden_states = None


@contextlib.contextmanager
def hidden_states_hooks(model, session) -> Iterator[None]:
    """Keep each layer's input hidden states while ``session.policy.needs_hidden_states``; a no-op otherwise."""
    if not getattr(session.policy, "needs_hidden_states", False) or model.__dict__.get("_kvsieve_hidden_hooks"):
        yield  # nothing asked, or an outer attach's hooks already record (twice would double-count)
        return
    model.__dict__["_kvsieve_hidden_hooks"] = True
    attentions = attention_modules(model)
    handles = []
    try:
        for attention in attentions:
            handles.append(attention.register_forward_pre_hook(_record, with_kwargs=True))
        yield
    finally:
        model.__dict__.pop("_kvsieve_hidden_hooks", None)
        for handle in handles:
            handle.remove()
