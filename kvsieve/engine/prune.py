"""Prune a cache that holds a whole prompt to one policy's budget: the one place a KVzip-style policy (scores from a
reconstruction) and every other policy part ways, so no caller branches on ``needs_reconstruction`` itself."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from kvsieve.engine.compress import CompressionReport, compress_cache
from kvsieve.engine.reconstruct import Reconstruction, compress_with_reconstruction
from kvsieve.policy import Policy
from kvsieve.selection import Budget

__all__ = ["prune_prompt"]


@torch.no_grad()
def prune_prompt(model, cache: DynamicCache, ids: torch.Tensor | None, policy: Policy, budget: Budget,
                 protected_tail: int = 0, report: CompressionReport | None = None,
                 reconstruction: Reconstruction | None = None, remember_scores: bool = False) -> CompressionReport:
    """Prune ``cache`` (the prompt ``ids`` read whole, its last ``protected_tail`` tokens kept on top of the budget)
    in place to ``policy``'s choice at ``budget``. A policy that needs a reconstruction repeats ``ids`` (or uses
    ``reconstruction``, computed on this same cache); ``remember_scores`` keeps an intrinsic policy's scores with
    the entries (a cache evicted again while it decodes)."""
    if policy.needs_reconstruction:
        if ids is None:
            raise ValueError(f"policy {policy.name!r} repeats the prompt's tokens: give input_ids, not embeddings")
        return compress_with_reconstruction(model, cache, ids, policy, budget, protected_tail, report, reconstruction)
    return compress_cache(cache, policy, budget, protected_tail, report, remember_scores=remember_scores)
