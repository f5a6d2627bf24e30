"""Per-request losses of candidate operating points against full KV on the same request.

A *request* is one evaluated sample (task, length, sample id). A *candidate* is one compressed
operating point (policy, compression ratio, question-awareness). Its loss on a request compares the
task's utility (the harness metric, 0-100) under the candidate with the full cache's:

* ``binary``: material degradation, 1 when ``full - candidate > epsilon`` points, else 0;
* ``bounded``: the utility drop scaled to [0, 1], ``clip((full - candidate) / 100, 0, 1)``.

Decode-time rows (the store's ``SPEC@decodeN``, eviction while the prompt is read in chunks of N
tokens) are candidates too. The question is part of that prompt, so evictions after its chunk see it:
such a candidate is not query-agnostic (:attr:`Point.setting` says what it is), and it is compared
with ``full@decodeN`` (the same chunked run with nothing evicted) where the store holds those rows.

Models are named by their canonical name: an alias of a bundled model (``qwen2.5-0.5b``) finds the
rows stored under the canonical name and under any alias (stores written before aliases were resolved).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsieve.bundled import bundled
from kvsieve.harness.store import ResultsStore
from kvsieve.policies.label import FULL_CACHE, Point
from kvsieve.tasks import task_family

__all__ = ["BUCKETINGS", "LOSSES", "UTILITY_SCALE", "LossTable", "candidate_losses", "candidates_for",
           "length_bucket", "loss_table", "model_names"]

LOSSES = ("binary", "bounded")
BUCKETINGS = ("none", "task", "task_family", "length")  # how a conditional contract splits requests
UTILITY_SCALE = 100.0  # harness metrics are percentages

Request = tuple[str, int, str]  # (task, length, sample_id)


def candidates_for(policies: list[str], ratios: list[float], question_aware: bool = False) -> list[Point]:
    """The candidates of ``kvsieve certify``: every compressing policy label at every ratio.

    Full-KV labels (``full``, ``full@decodeN``) are the reference, not candidates, and are dropped. Each candidate
    is a :class:`Point`, which refuses a ratio outside [0, 1) or a question-aware decode-time label, before any store
    is read. A file given by the path of a named program's or checkpoint's bytes is given by the name, as its rows
    are stored (:func:`kvsieve.policies.registry.parse`). ``policies`` are a user's labels (``--policies``): read as
    text here, once, as input; the rows are then found by each point's stored key.
    """
    compressing = [_as_stored(p) for p in map(Point.parse, policies) if p.compresses]
    if not compressing or not ratios:
        raise ValueError("give at least one compressing policy (--policies) and one ratio (--ratios)")
    return [Point(p.parsed or p.spec, r, question_aware, p.mode) for p in compressing for r in ratios]


def _as_stored(point: Point) -> Point:
    """``point`` under the label its rows are stored by; unchanged when its spec does not parse here (the store's
    reading names what is wrong)."""
    try:
        return Point(point.policy_spec, point.ratio, point.question_aware, point.mode)
    except ValueError:
        return point


def model_names(model: str) -> list[str]:
    """The names a model's rows may be stored under: a bundled model's canonical name, then its aliases."""
    entry = bundled(model)
    return [entry.name, *entry.aliases] if entry is not None else [model]


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
    losses: dict[Point, np.ndarray]
    kept_fraction: dict[Point, float] = field(default_factory=dict)  # mean cache bytes kept / full
    loss: str = "binary"
    epsilon: float = 0.0
    left_out: list[Request] = field(default_factory=list)  # requests some candidate or full KV lacks
    model: str = ""  # the canonical model name the rows were read for
    references: dict[Point, str] = field(default_factory=dict)  # the full-KV label each was compared with

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
                         dict(self.kept_fraction), self.loss, self.epsilon, list(self.left_out), self.model,
                         dict(self.references))

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


def _stored_models(store: ResultsStore) -> str:
    models = sorted({key.model for key in store.keys(policy=FULL_CACHE)})
    return ", ".join(models) if models else "none (the store has no full-KV rows at all)"


def _check_digests(cand: Point, rows: list, digest: str | None) -> None:
    """Refuse rows computed from other bytes than the files ``cand``'s spec names now (each row's config records
    ``policy_digest``; ordinary policies have none on either side): a contract records the files' digests as they
    are now, so certifying old rows would vouch for bytes they were never computed with."""
    stale = [r for r in rows if r.config.get("policy_digest") != digest]
    if stale:
        old = ", ".join(sorted({d[:12] if isinstance(d, str) else "unrecorded"
                                for d in (r.config.get("policy_digest") for r in stale)}))
        first = stale[0].key
        raise ValueError(f"{len(stale)} of {len(rows)} rows of candidate {cand} were computed from other file contents "
                         f"(sha256 {old}; first: task {first.task}, length {first.length}, sample {first.sample_id}), "
                         f"but its files now have sha256 {digest[:12] if digest else 'none'}: certifying them would "
                         "vouch for bytes they never ran. Restore the file, or evaluate it again into another --store "
                         "(kvsieve certify --run)")


def loss_table(store: ResultsStore, model: str, candidates: list[Point], epsilon: float = 0.0,
               loss: str = "binary", tasks: list[str] | None = None, lengths: list[int] | None = None) -> LossTable:
    """Build the loss table from the results store over the requests that full KV and every candidate share.

    ``model`` may be a bundled model's alias (see :func:`model_names`). A decode-time candidate is compared
    with ``full@decodeN`` rows when the store holds them, else with the prefill ``full`` rows
    (``LossTable.references`` records which). Requests that only some of them have (a grid still running,
    full-KV rows of tasks no candidate ran) are left out and listed in ``LossTable.left_out``. Raises
    ValueError when the store has no full-KV rows for the model (listing the models it holds), a candidate
    has no rows, or nothing is shared.
    """
    if not candidates:
        raise ValueError("no candidates to certify: give at least one compressing policy and ratio")
    names = model_names(model)
    filters: dict = {"model": names}
    if tasks:
        filters["task"] = list(tasks)
    if lengths:
        filters["length"] = list(lengths)

    def by_request(rows) -> dict:
        return {(r.key.task, r.key.length, r.key.sample_id): r for r in rows}

    def no_full() -> ValueError:
        shown = repr(model) if names[0] == model else f"{model!r} (canonical name {names[0]!r})"
        return ValueError(f"the store has no full-KV rows for model {shown}"
                          + (f" (tasks {tasks}, lengths {lengths})" if tasks or lengths else "")
                          + f"; it holds full-KV rows for: {_stored_models(store)}. Losses are measured against "
                          f"full KV on the same request: run policy {FULL_CACHE!r} first")

    full = {FULL_CACHE: by_request(store.rows(policy=FULL_CACHE, **filters))}
    if not full[FULL_CACHE] and not any(c.mode.is_decode for c in candidates):
        raise no_full()
    references: dict[Point, str] = {}
    found = {}
    digests: dict[str, str | None] = {}  # spec -> the sha256 of its files now, read once per spec
    for cand in candidates:
        rows = store.rows(policy=cand.policy, ratio=cand.ratio, question_aware=cand.question_aware, **filters)
        if not rows:
            raise ValueError(f"the store has no rows for candidate {cand} (model {names[0]!r}); "
                             "evaluate it first (kvsieve eval, or kvsieve certify --run)")
        if cand.spec not in digests:
            digests[cand.spec] = cand.policy_spec.digest
        _check_digests(cand, rows, digests[cand.spec])
        found[cand] = by_request(rows)
        reference = cand.reference.stored
        if reference not in full:
            full[reference] = by_request(store.rows(policy=reference, **filters))
        references[cand] = reference if full[reference] else FULL_CACHE
        if not full[references[cand]]:
            raise no_full()
    used = [full[name] for name in sorted(set(references.values()))]
    every = set().union(*used, *found.values())
    shared = set.intersection(*(set(d) for d in [*used, *found.values()]))
    if not shared:
        raise ValueError("full KV and the candidates share no request: evaluate the same samples with each")
    requests = sorted(shared)
    losses, kept = {}, {}
    for cand, rows in found.items():
        full_utility = np.array([full[references[cand]][r].score for r in requests])
        utility = np.array([rows[r].score for r in requests])
        losses[cand] = candidate_losses(utility, full_utility, epsilon, loss)
        kept[cand] = float(np.mean([rows[r].cache_bytes / max(1, rows[r].cache_bytes_full) for r in requests]))
    return LossTable(requests, losses, kept, loss, epsilon, sorted(every - shared), names[0], references)
