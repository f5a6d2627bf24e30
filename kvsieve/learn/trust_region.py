"""A trust region around the warm start: the KL from the warm start's first-draw distribution to the policy's.

REINFORCE from a good supervised policy can drift away from it on noise. The penalty keeps the policy near its
start: for each recorded decision, ``KL(p0 || p)`` where ``p0`` and ``p`` are the Plackett-Luce first-draw
distributions (the softmax of the keep logits over the free entries) of the warm start and of the policy, both
recomputed from what the decision recorded. It is zero, with a zero gradient, at the warm start, and grows as the
ranking of the candidates changes (a common shift of every logit, which changes no draw, costs nothing).
"""

from __future__ import annotations

import torch

__all__ = ["first_draw_kl"]


def first_draw_kl(reference: torch.Tensor, logits: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """Mean over the leading dims of ``KL(softmax(reference) || softmax(logits))`` over the entries not protected.

    ``reference`` and ``logits`` are (..., n) keep logits; ``protected`` (n,) entries are left out of both."""
    if reference.shape != logits.shape:
        raise ValueError(f"reference logits {tuple(reference.shape)} and logits {tuple(logits.shape)} differ in shape")
    ref = torch.log_softmax(reference.double().masked_fill(protected, float("-inf")), dim=-1)
    cur = torch.log_softmax(logits.double().masked_fill(protected, float("-inf")), dim=-1)
    p = ref.exp()
    terms = torch.where(p > 0, p * (ref - cur.masked_fill(p == 0, 0.0)), torch.zeros_like(p))
    return terms.sum(dim=-1).mean().float()
