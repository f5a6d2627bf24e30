"""The headline tables and paired comparisons, from stored cells (:meth:`ResultsStore.rows`).

Per model and context length, per policy and compression ratio:

- **mean** score over requests, where a *request* is one ``(task, length, sample_id)``;
- a **95% percentile-bootstrap interval** of that mean over requests (:mod:`kvsieve.bootstrap`, seeded
  alike for every cell, so cells with the same requests draw the same resamples);
- **% of full**: the policy's mean over the full cache's mean on the *same* requests, with a paired bootstrap
  interval (:func:`bootstrap_ratio_interval`: the targets of the field are stated in % of full);
- **bytes % of full**: the mean over requests of ``cache_bytes / cache_bytes_full`` (what the pruned
  cache physically holds against the full cache of the same row);
- **overhead % of prefill**: where paired cells recorded their own timing (shared grids do:
  ``compress_seconds``, the cell's cache copy, scoring, selection and gather, for KVzip also the
  reconstruction, and ``prefill_only_seconds``, the prefill it shares with the other cells of its sample,
  both timed in the same process), ``mean compress_seconds / mean prefill_only_seconds`` over the policy's
  cells that recorded both (how many is reported when not all did). Where none did, ``(mean prefill_seconds
  of the policy's cells - mean prefill_seconds of the full cells) / mean prefill_seconds of the full cells``
  on the same requests (a shared cell's ``prefill_seconds`` is the
  sample's prefill plus its compression, the full cell's the same prefill plus a copy); where the policy's
  and the full cell were computed in different runs (a resumed grid), the prefill's run-to-run noise is in
  that difference too. Question-aware cells (``+qa``) also include the question's forward pass;
  decode-time cells (``@decodeN``) are set against ``full@decodeN`` and measure eviction during the
  chunked read.

Only requests where both the policy and its full reference (:func:`kvsieve.harness.pairing.reference_cells`)
have a row count (paired); the number of the policy's requests left out for want of a full row is reported.
:func:`compare` gives the paired difference of two policies' means with a paired bootstrap interval.

Rows of several machines (``harness/provenance.py``; rows without provenance count as one more, unknown) are
never paired unless asked (``allow_mixed_machines``, ``kvsieve report --mixed-machines``): a difference
could be the machine's kernels. Every table says which machines, dtypes, threads and revisions its rows
came from. Rendering is :mod:`kvsieve.harness.headline_format`; reading a store, :mod:`kvsieve.harness.headline`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from kvsieve.bootstrap import DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_interval, bootstrap_ratio_interval
from kvsieve.bundled import canonical_name
from kvsieve.harness.pairing import (
    Cells,
    Request,
    by_layout,
    group_cells,
    layout_of,
    reference_cells,
    resolve_label,
)
from kvsieve.harness.provenance import check_one_machine, describe
from kvsieve.harness.store import RATIO_DECIMALS, TIMING_CONFIG_KEYS, CellResult
from kvsieve.policies.label import FULL_CACHE
from kvsieve.tasks.ruler_alt import PREFIX as ALT_PREFIX

__all__ = ["NOT_DISTINGUISHABLE", "Comparison", "Headline", "HeadlineRow", "compare", "headline"]

NOT_DISTINGUISHABLE = "not distinguishable"


@dataclass(frozen=True)
class HeadlineRow:
    """One (policy, ratio) of one model and length. Scores are in the store's units (0-100 for RULER)."""

    model: str
    length: int
    policy: str  # display name: ``+qa`` for question-aware cells
    ratio: float
    n: int  # paired requests
    mean: float
    low: float  # 95% bootstrap interval of the mean
    high: float
    full_mean: float  # the full reference's mean on the same requests
    pct_of_full: float  # nan when the full mean is 0
    bytes_pct: float  # mean of cache_bytes / cache_bytes_full, in %
    overhead_pct: float  # extra prefill seconds over the full cell's, in % of the full cell's
    unpaired: int = 0  # this policy's requests dropped because the full reference has no row there
    overhead_cells: int = 0  # cells the overhead comes from when they timed themselves; 0: the full-cell fallback
    pct_low: float = math.nan  # paired 95% bootstrap interval of % of full (the same requests resampled in both)
    pct_high: float = math.nan


@dataclass
class Headline:
    """The headline table of one model at one context length."""

    model: str
    length: int
    requests: int  # requests with a full-cache row
    tasks: list[str]
    rows: list[HeadlineRow]
    unpaired: list[str] = field(default_factory=list)  # "policy @ ratio" with no paired request at all
    layout: str = ""  # "" for the first RULER layout and other data, "fmt2" for the second layout's tasks
    provenance: str = ""  # the machines, dtypes, threads and revisions of the table's rows (provenance.describe)
    machines: int = 1  # how many machines computed them (rows without provenance count as one, unknown)


@dataclass(frozen=True)
class Comparison:
    """The paired difference ``a - b`` of two policies' means on the requests both have."""

    model: str
    length: int
    a: str
    b: str
    ratio: float
    n: int
    diff: float
    low: float
    high: float

    @property
    def distinguishable(self) -> bool:
        return not (self.low <= 0.0 <= self.high)

    @property
    def verdict(self) -> str:
        if not self.distinguishable:
            return NOT_DISTINGUISHABLE
        return f"{self.a} better" if self.diff > 0 else f"{self.b} better"


def _pct(num: float, den: float) -> float:
    return 100.0 * num / den if den else math.nan


def _row(model: str, length: int, label: str, ratio: float, cells: dict[Request, CellResult],
         ref: dict[Request, CellResult], resamples: int, seed: int) -> HeadlineRow | None:
    paired = sorted(set(cells) & set(ref))
    if not paired:
        return None
    scores = np.array([cells[q].score for q in paired], dtype=np.float64)
    full = np.array([ref[q].score for q in paired], dtype=np.float64)
    held = [cells[q].cache_bytes / cells[q].cache_bytes_full if cells[q].cache_bytes_full else math.nan
            for q in paired]
    timed = [c for c in (cells[q].config for q in paired) if all(k in c for k in TIMING_CONFIG_KEYS)]
    if timed:  # cells that timed their compression and its prefill in their own run: their figure alone
        prefill_only, compress = TIMING_CONFIG_KEYS
        overhead = _pct(float(np.mean([c[compress] for c in timed])), float(np.mean([c[prefill_only] for c in timed])))
    else:
        prefill = float(np.mean([cells[q].prefill_seconds for q in paired]))
        full_prefill = float(np.mean([ref[q].prefill_seconds for q in paired]))
        overhead = _pct(prefill - full_prefill, full_prefill)
    low, high = bootstrap_interval(scores, resamples, seed)
    mean, full_mean = float(scores.mean()), float(full.mean())
    return HeadlineRow(model, length, label, ratio, len(paired), mean, low, high, full_mean, _pct(mean, full_mean),
                       100.0 * float(np.mean(held)), overhead,
                       len(cells) - len(paired), len(timed), *bootstrap_ratio_interval(scores, full, resamples, seed))


def headline(rows: Iterable[CellResult], resamples: int = DEFAULT_RESAMPLES,
             seed: int = DEFAULT_SEED, allow_mixed_machines: bool = False) -> list[Headline]:
    """One :class:`Headline` per (model, length, layout) in ``rows``: the full reference first, then every ratio's
    policies (ordinary ones by mean, best first, then reference policies such as ``oracle+qa``).

    ``ValueError`` when a table's rows come from several machines, unless ``allow_mixed_machines``."""
    groups = [(model, length, layout, cells) for layout, part in by_layout(rows).items()
              for (model, length), cells in group_cells(part).items()]
    out = []
    for model, length, layout, cells in sorted(groups, key=lambda g: g[:3]):
        full_requests = set(cells.get((FULL_CACHE, 0.0), {}))
        tasks = sorted({q[0] for by_request in cells.values() for q in by_request})
        provenances = [r.provenance for by_request in cells.values() for r in by_request.values()]
        what = f"the {model} table at {length} tokens" + (f", layout {layout}" if layout else "")
        count = len(check_one_machine(provenances, what, allow_mixed_machines))
        table = Headline(model, length, len(full_requests), tasks, [], layout=layout,
                         provenance=describe(provenances), machines=count)
        built: list[HeadlineRow] = []
        for label, ratio in cells:
            row = _row(model, length, label, ratio, cells[(label, ratio)], reference_cells(cells, label), resamples,
                       seed)
            if row is None:
                table.unpaired.append(f"{label} @ {ratio:g}")
            else:
                built.append(row)
        points = cells.points
        built.sort(key=lambda r: (not points[r.policy].is_full, r.ratio, points[r.policy].is_reference, -r.mean,
                                  r.policy))
        table.rows = built
        table.unpaired.sort()
        out.append(table)
    return out


def _single_group(rows: Iterable[CellResult], model: str | None, length: int | None) -> tuple[str, int, Cells]:
    groups = group_cells(rows)
    if model is not None:
        groups = {k: v for k, v in groups.items() if k[0] == canonical_name(model)}
    if length is not None:
        groups = {k: v for k, v in groups.items() if k[1] == int(length)}
    if len(groups) != 1:
        held = ", ".join(f"{m} @ {n}" for m, n in sorted(group_cells(rows) if not groups else groups)) or "none"
        what = "no rows" if not groups else "rows of several models or lengths"
        raise ValueError(f"compare needs the rows of one model at one length, got {what} "
                         f"(model={model!r}, length={length!r}); held: {held}")
    (m, n), cells = next(iter(groups.items()))
    layouts = {layout_of(q[0]) for by_request in cells.values() for q in by_request}
    if len(layouts) > 1:
        raise ValueError(f"compare needs the rows of one prompt layout, got tasks of {len(layouts)} (first layout and "
                         f"{ALT_PREFIX}...): compare each layout's rows apart")
    return m, n, cells


def compare(rows: Iterable[CellResult], a: str, b: str, ratio: float, model: str | None = None,
            length: int | None = None, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
            allow_mixed_machines: bool = False) -> Comparison:
    """The paired difference of means ``a - b`` at ``ratio`` over the requests both have, with its paired
    bootstrap 95% interval (the differences per request resampled). A full-cache policy (``full``,
    ``full@decodeN``) is taken at its own ratio, 0. ``model``/``length`` pick one group where ``rows`` hold
    several. Raises ``ValueError`` naming what is missing, or the machines when the paired rows come from
    several and ``allow_mixed_machines`` is false."""
    rows = list(rows)
    m, n, cells = _single_group(rows, model, length)
    ratio = round(float(ratio), RATIO_DECIMALS)
    picked = []
    for name in (a, b):
        label = resolve_label(cells, name, m)
        at = reference_cells(cells, label) if cells.points[label].is_full else cells.get((label, ratio))
        if not at:
            ratios = sorted(r for lab, r in cells if lab == label)
            raise ValueError(f"policy {label!r} has no rows at ratio {ratio:g} for model {m}; "
                             f"its ratios: {', '.join(f'{r:g}' for r in ratios)}")
        picked.append((label, at))
    (la, ca), (lb, cb) = picked
    paired = sorted(set(ca) & set(cb))
    if not paired:
        raise ValueError(f"{la} and {lb} at ratio {ratio:g} share no request for model {m}")
    check_one_machine([c[q].provenance for c in (ca, cb) for q in paired], f"{la} - {lb} at ratio {ratio:g}",
                      allow_mixed_machines)
    d = np.array([ca[q].score - cb[q].score for q in paired], dtype=np.float64)
    low, high = bootstrap_interval(d, resamples, seed)
    return Comparison(m, n, la, lb, ratio, len(paired), float(d.mean()), low, high)
