"""Held-out per-step KL during training: the greedy policy on requests it never trains on, every ``eval_every`` steps.

Each held-out request is an episode as training builds it (chat-templated context, then question and reference
answer read with teacher forcing), generated from ``eval_seed`` (default 6000: disjoint from training's 5000+,
from evaluation grids' 0+ and evolution's 1000/2000). Per request and ratio the greedy policy (no Gumbel noise)
compresses the context's full cache once (prefill mode) and the continuation is read on it; the number kept is
the mean KL(full || compressed) per continuation token, the training reward's negative. The context caches and
the full-cache teachers do not depend on the policy: computed once per request.

Rows (``heldout.csv``): ``step, episode, ratio, kl``; the stopping rule (:mod:`kvsieve.learn.stopping`) reads their
mean per step. The paired interval of two steps is over requests (:func:`paired_interval`).
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

import torch

from kvsieve.learn.rollout import Episode, context_cache_for, rollout, teacher_for
from kvsieve.selection import Budget

__all__ = ["HeldOut", "HELDOUT_FIELDS", "read_heldout", "write_heldout", "mean_by_step", "paired_interval"]

HELDOUT_FIELDS = ("step", "episode", "ratio", "kl")


class HeldOut:
    """Greedy held-out KL of a policy at ``ratios`` on ``episodes``; caches and teachers kept across evaluations."""

    def __init__(self, model, episodes: list[Episode], ratios: list[float], window: int, top_k: int | None) -> None:
        if not episodes:
            raise ValueError("held-out evaluation needs at least one episode")
        self.model, self.episodes, self.ratios = model, episodes, list(ratios)
        self.window, self.top_k = window, top_k
        self._caches: dict[int, object] = {}
        self._teachers: dict[int, object] = {}

    def _prepared(self, index: int):
        if index not in self._caches:
            episode = self.episodes[index]
            self._caches[index] = context_cache_for(self.model, episode, self.window)
            self._teachers[index] = teacher_for(self.model, episode, "prefill", self.window, 1, self.top_k,
                                                self._caches[index])
        return self._caches[index], self._teachers[index]

    @torch.no_grad()
    def evaluate(self, make_policy, step: int) -> list[dict]:
        """Rows ``{step, episode, ratio, kl}``; ``make_policy(shared)`` gives a fresh greedy policy, ``shared`` a dict
        its scores of one request's cache may be kept in for the other ratios (or ignored)."""
        rows = []
        for index, episode in enumerate(self.episodes):
            cache, teacher = self._prepared(index)
            shared: dict = {}
            for ratio in self.ratios:
                kept = Budget(ratio=ratio).resolve(episode.context.shape[1])
                result = rollout(self.model, episode, make_policy(shared), "prefill", kept, 1, teacher, cache)
                rows.append({"step": step, "episode": episode.name or str(index), "ratio": ratio,
                             "kl": float(result.kl.mean()) if result.kl.numel() else 0.0})
        return rows


def read_heldout(path: Path, through: int) -> list[dict]:
    """The rows of ``path`` with ``step <= through`` (a resumed run redoes later ones)."""
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if int(r["step"]) <= through]
    return [{"step": int(r["step"]), "episode": r["episode"], "ratio": float(r["ratio"]), "kl": float(r["kl"])}
            for r in rows]


def write_heldout(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=HELDOUT_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in HELDOUT_FIELDS})
    tmp.replace(path)


def mean_by_step(rows: list[dict], ratio: float | None = None) -> list[tuple[int, float]]:
    """``(step, mean KL)`` per evaluated step in step order, over every request (and ratio, unless one is given)."""
    sums: dict[int, list[float]] = {}
    for r in rows:
        if ratio is None or r["ratio"] == ratio:
            sums.setdefault(r["step"], []).append(r["kl"])
    return [(s, sum(v) / len(v)) for s, v in sorted(sums.items())]


def paired_interval(a: list[float], b: list[float], resamples: int = 10000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, float]:
    """Mean of ``a - b`` over paired requests and its percentile bootstrap interval (seeded: reproducible)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired values need equal, non-zero lengths, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return sum(diffs) / n, means[int(tail * resamples)], means[min(resamples - 1, int((1 - tail) * resamples))]
