"""Per-request losses of candidate operating points against full KV on the same request.

A *request* is one evaluated sample (task, length, sample id). A *candidate* is one compressed
operating point (policy, compression ratio, question-awareness). Its loss on a request compares the
task's utility (the harness metric, 0-100) under the candidate with the full cache's:

* ``binary``: material degradation, 1 when ``full - candidate > epsilon`` points, else 0;
* ``bounded``: the utility drop scaled to [0, 1], ``clip((full - candidate) / 100, 0, 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsieve.harness.store import ResultsStore
from kvsieve.tasks import task_family

__all__ = ["BUCKETINGS", "LOSSES", "Candidate", "LossTable", "candidate_losses", "length_bucket", "loss_table"]

LOSSES = ("binary", "bounded")
BUCKETINGS = ("none", "task", "task_family", "length")  # how a conditional contract splits requests
UTILITY_SCALE = 100.0  # harness metrics are percentages

Request = tuple[str, int, str]  # (task, length, sample_id)


@dataclass(frozen=True, order=True)
class Candidate:
    """One compressed operating point. ``retention`` is the fraction of the cache kept (1 - ratio)."""

    policy: str
    ratio: float
    question_aware: bool = False

    @property
    def retention(self) -> float:
        return round(1.0 - self.ratio, 6)

    @property
    def compressor(self) -> tuple[str, bool]:
        """Candidates of one compressor form one fixed-sequence chain."""
        return self.policy, self.question_aware

    def __str__(self) -> str:
        return f"{self.policy}{'+qa' if self.question_aware else ''}@{self.ratio:g}"


def candidate_losses(candidate_utility: np.ndarray, full_utility: np.ndarray, epsilon: float,
                     loss: str = "binary") -> np.ndarray:
    """Loss per request in [0, 1] (see the module docstring)."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is not one of {', '.join(LOSSES)}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0 (utility points), got {epsilon!r}")
    drop = np.asarray(full_utility, dtype=float) - np.asarray(candidate_utility, dtype=float)
    if loss == "binary":
        return (drop > epsilon).astype(float)
    return np.clip(drop / UTILITY_SCALE, 0.0, 1.0)


@dataclass
class LossTable:
    """Losses of every candidate on one common set of requests (rows aligned with ``requests``)."""

    requests: list[Request]
    losses: dict[Candidate, np.ndarray]
    kept_fraction: dict[Candidate, float] = field(default_factory=dict)  # mean cache bytes kept / full
    loss: str = "binary"
    epsilon: float = 0.0
    left_out: list[Request] = field(default_factory=list)  # requests some candidate or full KV lacks

    def left_out_summary(self) -> str:
        """``""`` or e.g. ``"left out 25 request(s) not every candidate and full KV have: qa_2 (5), vt (20)"``."""
        if not self.left_out:
            return ""
        counts: dict[str, int] = {}
        for task, _, _ in self.left_out:
            counts[task] = counts.get(task, 0) + 1
        listed = ", ".join(f"{task} ({n})" for task, n in sorted(counts.items()))
        return f"left out {len(self.left_out)} request(s) not every candidate and full KV have: {listed}"

    @property
    def n(self) -> int:
        return len(self.requests)

    def subset(self, rows: np.ndarray | list[int]) -> LossTable:
        rows = np.asarray(rows, dtype=int)
        return LossTable([self.requests[i] for i in rows], {c: v[rows] for c, v in self.losses.items()},
                         dict(self.kept_fraction), self.loss, self.epsilon, list(self.left_out))

    def buckets(self, by: str | None, length_edges: list[int] | None = None) -> dict[str, np.ndarray]:
        """Row indices per bucket: one bucket ``all``, or per task, task family or context-length bucket."""
        if by in (None, "none"):
            return {"all": np.arange(self.n)}
        if by == "task":
            names = [task for task, _, _ in self.requests]
        elif by == "task_family":
            names = [task_family(task) for task, _, _ in self.requests]
        elif by == "length":
            if not length_edges:
                raise ValueError("bucketing by length needs length_edges, e.g. [2048, 4096]")
            names = [length_bucket(length, length_edges) for _, length, _ in self.requests]
        else:
            raise ValueError(f"by={by!r} is not one of {', '.join(BUCKETINGS)}")
        rows: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            rows.setdefault(name, []).append(i)
        return {name: np.asarray(idx) for name, idx in sorted(rows.items())}


def length_bucket(length: int, edges: list[int]) -> str:
    """``<=E`` for the first edge E with ``length <= E``; ``>E_last`` beyond the last edge."""
    for edge in sorted(edges):
        if length <= edge:
            return f"<={edge}"
    return f">{max(edges)}"


def loss_table(store: ResultsStore, model: str, candidates: list[Candidate], epsilon: float = 0.0,
               loss: str = "binary", tasks: list[str] | None = None, lengths: list[int] | None = None) -> LossTable:
    """Build the loss table from the results store over the requests that full KV and every candidate share.

    Requests that only some of them have (a grid still running, full-KV rows of tasks no candidate ran)
    are left out and listed in ``LossTable.left_out``. Raises ValueError when the store has no full-KV
    rows, a candidate has no rows, or nothing is shared.
    """
    if not candidates:
        raise ValueError("no candidates to certify: give at least one compressing policy and ratio")
    filters: dict = {"model": model}
    if tasks:
        filters["task"] = list(tasks)
    if lengths:
        filters["length"] = list(lengths)
    full = {(r.key.task, r.key.length, r.key.sample_id): r.score for r in store.rows(policy="full", **filters)}
    if not full:
        raise ValueError(f"the store has no full-KV rows for model {model!r}"
                         + (f" (tasks {tasks}, lengths {lengths})" if tasks or lengths else "")
                         + ": losses are measured against full KV on the same request; run policy 'full' first")
    found = {}
    for cand in candidates:
        rows = store.rows(policy=cand.policy, ratio=cand.ratio, question_aware=cand.question_aware, **filters)
        if not rows:
            raise ValueError(f"the store has no rows for candidate {cand} (model {model!r}); "
                             "evaluate it first (kvsieve eval, or kvsieve certify --run)")
        found[cand] = {(r.key.task, r.key.length, r.key.sample_id): r for r in rows}
    every = set(full).union(*found.values())
    shared = set(full).intersection(*found.values())
    if not shared:
        raise ValueError("full KV and the candidates share no request: evaluate the same samples with each")
    requests = sorted(shared)
    full_utility = np.array([full[r] for r in requests])
    losses, kept = {}, {}
    for cand, by_request in found.items():
        utility = np.array([by_request[r].score for r in requests])
        losses[cand] = candidate_losses(utility, full_utility, epsilon, loss)
        kept[cand] = float(np.mean([by_request[r].cache_bytes / max(1, by_request[r].cache_bytes_full)
                                    for r in requests]))
    return LossTable(requests, losses, kept, loss, epsilon, left_out=sorted(every - shared))
