"""The per-step reward: minus KL(full cache || compressed cache) of the next-token distributions.

DistillCache trains "with REINFORCE via a per-step KL-divergence reward to preserve the full-cache
output distribution" (paper abstract). The full-cache (teacher) distributions of a training sample do
not depend on the policy, so they are computed once per sample and cached (:class:`Teacher`).

Memory: a full distribution per position costs ``vocab`` floats (49k for SmolLM2, 152k for Qwen2.5),
so the teacher may keep only its ``top_k`` most likely tokens per position plus one "rest" bin holding
the remaining mass. The KL is then computed between the coarsened distributions (the ``top_k``
tokens and the rest bin, the same bins for teacher and student). Coarsening never increases a KL
(data-processing inequality), so this is a lower bound of the full KL that is exact at ``top_k=None``
and, like the full KL, exactly zero when the student's logits equal the teacher's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Teacher", "teacher_from_logits", "kl_per_position", "binned_log_probs"]


@dataclass
class Teacher:
    """Full-cache next-token distributions of one sample at positions ``start .. start + T - 1``.

    ``log_probs`` (T, K): the teacher's log-probabilities of ``indices`` (T, K); ``rest`` (T,): log of
    the mass outside them (``-inf`` when ``K`` is the whole vocabulary, i.e. ``top_k=None``).
    """

    log_probs: torch.Tensor
    indices: torch.Tensor | None  # None: the whole vocabulary, in order
    rest: torch.Tensor
    start: int

    @property
    def length(self) -> int:
        return self.log_probs.shape[0]


def binned_log_probs(logits: torch.Tensor, indices: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) log-probabilities of ``indices`` and (...) log of the rest, from (..., V) logits.

    Teacher and student go through this same function, so equal logits give bitwise-equal bins.
    """
    log_p = torch.log_softmax(logits.float(), dim=-1)
    if indices is None:
        return log_p, torch.full(log_p.shape[:-1], float("-inf"))
    picked = log_p.gather(-1, indices.expand(*log_p.shape[:-1], indices.shape[-1]))
    rest = torch.logsumexp(log_p.scatter(-1, indices.expand_as(picked), float("-inf")), dim=-1)
    return picked, rest


@torch.no_grad()
def teacher_from_logits(logits: torch.Tensor, start: int = 0, top_k: int | None = 256) -> Teacher:
    """Teacher of (T, V) full-cache logits at positions ``start..``; ``top_k=None`` keeps every token."""
    if logits.dim() != 2:
        raise ValueError(f"teacher logits must be (positions, vocab), got shape {tuple(logits.shape)}")
    if top_k is not None and not 0 < top_k:
        raise ValueError(f"teacher top_k must be a positive int or None, got {top_k!r}")
    indices = None
    if top_k is not None and top_k < logits.shape[-1]:
        indices = torch.topk(logits.float(), top_k, dim=-1).indices
    log_probs, rest = binned_log_probs(logits, indices)
    return Teacher(log_probs, indices, rest, start)


def kl_per_position(teacher: Teacher, student_logits: torch.Tensor) -> torch.Tensor:
    """(T,) KL(teacher || student) per position from (T, V) student logits at the teacher's positions."""
    if student_logits.shape[0] != teacher.length:
        raise ValueError(f"student logits cover {student_logits.shape[0]} positions, the teacher {teacher.length}")
    q, q_rest = binned_log_probs(student_logits, teacher.indices)
    p = teacher.log_probs.exp()
    kl = torch.where(p > 0, p * (teacher.log_probs - q), torch.zeros_like(p)).sum(dim=-1)
    p_rest = teacher.rest.exp()
    rest_term = torch.where(p_rest > 0, p_rest * (teacher.rest - q_rest), torch.zeros_like(p_rest))
    return (kl + rest_term).clamp_min(0.0)
