"""Stage 1 of the cascade: the invariants every candidate's scores must hold on synthetic features.

:func:`check_invariants` runs a score function on the cases of :func:`invariant_cases` (synthetic feature shapes,
then the dev features' own shapes with synthetic values) and checks :data:`INVARIANTS` in order: a float tensor of
the score shape, finite, inputs left unchanged, the same scores again, and a selection within the budget. The
sandboxed worker (``worker.py``) runs it before scoring the dev features; nothing here touches a file or a process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from kvsieve.language.program_features import Features, synthetic_features
from kvsieve.language.program_source import Program

__all__ = ["INVARIANTS", "check_invariants", "describe_output", "invariant_cases"]

INVARIANTS = ("tensor", "float", "shape", "finite", "inputs_unchanged", "deterministic", "budget")


def invariant_cases(window: int, seeds: Iterable[int], real_shapes: Iterable[tuple[int, ...]] = ()) -> list[dict]:
    """Synthetic feature shapes for stage 1: one and three query heads, a context just above the window
    and a longer one (so both ends of the budget range and the chunk grid are exercised), and then the
    dev features' own (b, h, g, n) shapes with synthetic values, so a program cannot tell stage 1's
    inputs from the dev set's by their shape."""
    cases = []
    for seed in seeds:
        cases.append(dict(seed=int(seed), batch=1, kv_heads=2, group=1, n=window + 5, window=window, layer=0.0))
        cases.append(dict(seed=int(seed), batch=2, kv_heads=2, group=3, n=4 * window + 37, window=window, layer=0.6))
    for b, h, g, n in sorted(set(real_shapes)):
        cases.append(dict(seed=int(next(iter(seeds), 0)), batch=b, kv_heads=h, group=g, n=n, window=window,
                          layer=0.5))
    return cases


def check_invariants(score_fn: Callable[[Features], object], program: Program, window: int,
                     seeds: Iterable[int] = (0, 1), real_shapes: Iterable[tuple[int, ...]] = ()
                     ) -> tuple[dict[str, bool], str]:
    """Stage 1: run ``score_fn`` on synthetic features and check the contract.

    Returns ``(invariants, reason)``: the checks that ran, in :data:`INVARIANTS` order, each ``True``
    or ``False``, stopping at the first failure, which ``reason`` names with its case ("" when all
    hold). Exceptions raised by ``score_fn`` propagate (the caller reports them as errors).
    """
    results: dict[str, bool] = {}
    selection = program.selection(window)

    def verdict(name: str, ok: bool) -> bool:
        results[name] = results.get(name, True) and bool(ok)
        return bool(ok)

    for case in invariant_cases(window, seeds, real_shapes):
        label = f"seed {case['seed']}, group {case['group']}, n {case['n']}"
        features = synthetic_features(**case)
        before = {name: t.clone() for name, t in features.tensors().items()}
        scalars = features.scalars()
        out = score_fn(features)
        for name in INVARIANTS:
            if not verdict(name, _holds(name, out, features, before, scalars, score_fn, case, selection)):
                detail = f" (got {describe_output(out)})" if name in ("tensor", "float", "shape") else ""
                return results, f"invariant {name!r} fails on synthetic features ({label}){detail}"
    return results, ""


def _holds(name: str, out, features: Features, before, scalars, score_fn, case: dict, selection) -> bool:
    if name == "tensor":
        return type(out) is torch.Tensor
    if name == "float":
        return out.is_floating_point()
    if name == "shape":
        return tuple(out.shape) == features.score_shape
    if name == "finite":
        return bool(torch.isfinite(out).all())
    if name == "inputs_unchanged":
        return _unchanged(features, before, scalars)
    if name == "deterministic":
        return _same_again(score_fn, case, out)
    return _within_budget(selection, out, features.n)


def _unchanged(features: Features, before: dict[str, torch.Tensor], scalars: dict) -> bool:
    now = features.tensors()
    return features.scalars() == scalars and all(
        type(now[k]) is torch.Tensor and now[k].shape == v.shape and torch.equal(now[k], v) for k, v in before.items())


def _same_again(score_fn, case: dict, first: torch.Tensor) -> bool:
    again = score_fn(synthetic_features(**case))
    return type(again) is torch.Tensor and again.dtype == first.dtype and torch.equal(again, first)


def _within_budget(selection, scores: torch.Tensor, n: int) -> bool:
    """Distinct in-range entries within the budget, at a tight and a loose budget: at most ``kept`` per head
    (uniform allocation), or at most ``kept`` times the heads per batch row when the budget moves between heads
    (``allocation`` "layer" or "global", which within one layer's scores is "layer"; a head may then keep more
    than ``kept``). (Whether the selection's protected entries fit the dev set's real budgets is checked in the
    parent, before the candidate runs: ``cascade.selection_problem``.)"""
    protected = int(selection.protected_mask(n, n).sum())
    for kept in sorted({min(n, protected + 1), min(n, protected + (n - protected) // 2)}):
        indices, valid = selection.kept_indices(scores.detach().float(), kept)
        counts = valid.sum(-1) if valid is not None else torch.full(indices.shape[:-1], indices.shape[-1])
        if selection.allocation == "uniform":
            over = bool((counts > kept).any())
        else:
            over = bool((counts.sum(-1) > kept * indices.shape[1]).any())
        if over or (indices.numel() and (indices.min() < 0 or indices.max() >= n)):
            return False
        if indices.shape[-1] > 1 and not bool((indices.diff(dim=-1) > 0).all()):
            return False
    return True


def describe_output(out: object) -> str:
    """What a score function returned, in words (its dtype and shape when a tensor)."""
    if type(out) is torch.Tensor:
        return f"{out.dtype} tensor of shape {tuple(out.shape)}"
    return type(out).__name__
