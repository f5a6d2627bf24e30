"""The headline benchmark's statistics, from stored cells (:meth:`ResultsStore.rows`).

Per model and context length, per policy and compression ratio:

- **mean** score over requests, where a *request* is one ``(task, length, sample_id)``;
- a **95% percentile-bootstrap interval** of that mean over requests (Efron & Tibshirani, *An
  Introduction to the Bootstrap*, 1993, ch. 13): ``resamples`` means of ``n`` requests drawn with
  replacement, their 2.5% and 97.5% quantiles. Seeded, and the same seed for every cell: cells with the
  same requests draw the same resample indices, so their intervals are directly comparable;
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

Only requests where both the policy and its full reference have a row count (paired); the number of the
policy's requests left out for want of a full row is reported. :func:`compare` gives the paired
difference of two policies' means with a paired bootstrap interval.

Rows of several machines (``harness/provenance.py``; rows without provenance count as one more, unknown) are
never paired unless asked (``allow_mixed_machines``, ``kvsieve report --mixed-machines``): a difference
could be the machine's kernels. Every table says which machines, dtypes, threads and revisions its rows
came from.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsieve.bundled import canonical_name
from kvsieve.harness.provenance import check_one_machine, describe
from kvsieve.harness.store import RATIO_DECIMALS, TIMING_CONFIG_KEYS, CellResult, ResultsStore
from kvsieve.policies.label import FULL_CACHE, Label
from kvsieve.tasks.ruler_alt import PREFIX as ALT_PREFIX
from kvsieve.tasks.ruler_alt import is_alt_task

__all__ = ["DEFAULT_RESAMPLES", "DEFAULT_SEED", "Comparison", "Headline", "HeadlineRow", "bootstrap_interval",
           "bootstrap_ratio_interval",
           "compare", "format_comparisons", "format_headline", "headline", "headline_report", "layout_of"]

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0
LEVEL = 0.95
BLOCK = 1000  # resamples drawn per call to the generator, so memory stays at BLOCK x n indices
NOT_DISTINGUISHABLE = "not distinguishable"

Request = tuple[str, int, str]  # (task, length, sample_id)


def _check_resampling(resamples: int, level: float) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an int >= 1, got {resamples!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")


def _resample_blocks(n: int, resamples: int, seed: int) -> Iterator[np.ndarray]:
    """The resampled request indices, ``integers(0, n, (b, n))`` of ``default_rng(seed)`` in blocks of at most
    ``BLOCK`` resamples (memory stays at ``BLOCK x n`` indices)."""
    rng = np.random.default_rng(seed)
    for start in range(0, resamples, BLOCK):
        yield rng.integers(0, n, size=(min(BLOCK, resamples - start), n))


def _percentile_interval(statistics: np.ndarray, level: float) -> tuple[float, float]:
    low, high = np.quantile(statistics, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def bootstrap_interval(values: Sequence[float] | np.ndarray, resamples: int = DEFAULT_RESAMPLES,
                       seed: int = DEFAULT_SEED, level: float = LEVEL) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of ``values`` at confidence ``level``.

    The resample indices come from ``np.random.default_rng(seed)``, drawn as ``integers(0, n, (b, n))``
    in blocks of at most ``BLOCK`` resamples; the bounds are ``np.quantile`` (linear interpolation) of
    the ``resamples`` means at ``(1 - level) / 2`` and ``(1 + level) / 2``.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"bootstrap needs a non-empty 1-d list of values, got shape {x.shape}")
    _check_resampling(resamples, level)
    means = np.concatenate([x[idx].mean(axis=1) for idx in _resample_blocks(x.size, resamples, seed)])
    return _percentile_interval(means, level)


def bootstrap_ratio_interval(numerator: Sequence[float] | np.ndarray, denominator: Sequence[float] | np.ndarray,
                             resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                             level: float = LEVEL) -> tuple[float, float]:
    """Paired percentile-bootstrap interval of ``100 * mean(numerator) / mean(denominator)`` (e.g. a policy's
    % of full): the same resampled requests in both, drawn as in :func:`bootstrap_interval`; resamples whose
    denominator mean is 0 are left out (all of them: ``(nan, nan)``)."""
    num, den = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    if num.ndim != 1 or num.size == 0 or num.shape != den.shape:
        raise ValueError(f"a paired bootstrap needs two non-empty 1-d lists of one length, got shapes {num.shape} "
                         f"and {den.shape}")
    _check_resampling(resamples, level)
    ratios = []
    for idx in _resample_blocks(num.size, resamples, seed):
        top, bottom = num[idx].mean(axis=1), den[idx].mean(axis=1)
        ratios.append(100.0 * top[bottom > 0] / bottom[bottom > 0])
    ratios = np.concatenate(ratios)
    return _percentile_interval(ratios, level) if ratios.size else (math.nan, math.nan)


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


def layout_of(task: str) -> str:
    """Which prompt layout a task's samples use: ``fmt2`` (``tasks/ruler_alt.py``) or ``""`` (every other)."""
    return ALT_PREFIX.rstrip(":") if is_alt_task(task) else ""


def _by_layout(rows: Iterable[CellResult]) -> dict[str, list[CellResult]]:
    """Rows split by layout: each layout gets its own tables, never one mean over both."""
    parts: dict[str, list[CellResult]] = defaultdict(list)
    for r in rows:
        parts[layout_of(r.key.task)].append(r)
    return parts


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


# -- grouping -------------------------------------------------------------------------------------------------

_Cells = dict[tuple[str, float], dict[Request, CellResult]]  # (label, ratio) -> request -> cell


def _group(rows: Iterable[CellResult]) -> dict[tuple[str, int], _Cells]:
    """(model, length) -> (label, ratio) -> request -> cell. Rows of different models never mix."""
    groups: dict[tuple[str, int], _Cells] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        k = r.key
        label = Label.parse(k.policy, k.question_aware).display
        groups[(k.model, int(k.length))][(label, round(float(k.ratio), RATIO_DECIMALS))][
            (k.task, int(k.length), k.sample_id)] = r
    return groups


def _reference(cells: _Cells, label: str) -> dict[Request, CellResult]:
    """The full-cache cells for ``label``: the reference label at its lowest stored ratio (normally 0)."""
    ref = Label.parse(label).reference.display
    ratios = sorted(ratio for name, ratio in cells if name == ref)
    return cells[(ref, ratios[0])] if ratios else {}


def _order(labels: Iterable[str]) -> list[str]:
    return sorted(set(labels), key=lambda n: (not Label.parse(n).is_full, Label.parse(n).is_reference, n))


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
    groups = [(model, length, layout, cells) for layout, part in _by_layout(rows).items()
              for (model, length), cells in _group(part).items()]
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
            row = _row(model, length, label, ratio, cells[(label, ratio)], _reference(cells, label), resamples, seed)
            if row is None:
                table.unpaired.append(f"{label} @ {ratio:g}")
            else:
                built.append(row)
        built.sort(key=lambda r: (not Label.parse(r.policy).is_full, r.ratio, Label.parse(r.policy).is_reference,
                                  -r.mean, r.policy))
        table.rows = built
        table.unpaired.sort()
        out.append(table)
    return out


# -- comparisons ----------------------------------------------------------------------------------------------


def _resolve(cells: _Cells, name: str, model: str) -> str:
    """A display label for ``name``: exact (``oracle+qa``), or a policy spec held under one label only."""
    labels = {label for label, _ in cells}
    if name in labels:
        return name
    matches = {label for label in labels if Label.parse(label).stored == name}
    if len(matches) == 1:
        return matches.pop()
    problem = "has no rows" if not matches else f"is ambiguous ({', '.join(sorted(matches))})"
    raise ValueError(f"policy {name!r} {problem} for model {model}; available: {', '.join(_order(labels))}")


def _single_group(rows: Iterable[CellResult], model: str | None, length: int | None) -> tuple[str, int, _Cells]:
    groups = _group(rows)
    if model is not None:
        groups = {k: v for k, v in groups.items() if k[0] == canonical_name(model)}
    if length is not None:
        groups = {k: v for k, v in groups.items() if k[1] == int(length)}
    if len(groups) != 1:
        held = ", ".join(f"{m} @ {n}" for m, n in sorted(_group(rows) if not groups else groups)) or "none"
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
        label = _resolve(cells, name, m)
        at = _reference(cells, label) if Label.parse(label).is_full else cells.get((label, ratio))
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


def _pair_ratios(cells: _Cells, a: str, b: str) -> list[float]:
    """The ratios a pair can be compared at: both sides' common ratios; a full-cache side fits every ratio."""
    def ratios(label: str) -> set[float]:
        return {r for name, r in cells if name == label}

    full_a, full_b = Label.parse(a).is_full, Label.parse(b).is_full
    if full_a and full_b:
        return [0.0]
    return sorted(ratios(b) if full_a else ratios(a) if full_b else ratios(a) & ratios(b))


# -- rendering ------------------------------------------------------------------------------------------------


def _num(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def format_headline(table: Headline, digits: int = 1) -> str:
    """Markdown: a heading naming the model, length and requests, then one row per (policy, ratio)."""
    layout = f", layout {table.layout}" if table.layout else ""
    lines = [f"### {table.model} at {table.length} tokens{layout}: {table.requests} requests, {len(table.tasks)} task"
             f"{'s' if len(table.tasks) != 1 else ''}", ""]
    if table.provenance:
        mixed = (f"rows of {table.machines} machines paired, as asked (--mixed-machines): " if table.machines > 1
                 else "")
        lines += [f"Rows from: {mixed}{table.provenance}.", ""]
    lines += ["| policy | ratio | mean | 95% CI | % of full | its 95% CI | bytes % of full | overhead % of prefill "
              "| n |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table.rows:
        ci = f"[{_num(r.low, digits)}, {_num(r.high, digits)}]"
        pct_ci = f"[{_num(r.pct_low, 0)}, {_num(r.pct_high, 0)}]"
        lines.append(f"| {r.policy} | {r.ratio:g} | {_num(r.mean, digits)} | {ci} | {_num(r.pct_of_full)} | {pct_ci} | "
                     f"{_num(r.bytes_pct)} | {_num(r.overhead_pct)} | {r.n} |")
    dropped = [f"{r.policy} @ {r.ratio:g}: {r.unpaired}" for r in table.rows if r.unpaired]
    notes = []
    if dropped:
        notes.append("requests without a full-cache row, left out: " + "; ".join(dropped))
    if table.unpaired:
        notes.append("no request paired with the full cache (not shown): " + "; ".join(table.unpaired))
    partly = [r for r in table.rows if 0 < r.overhead_cells < r.n]
    if partly:
        counts = {(r.overhead_cells, r.n) for r in partly}
        which = (f"every row, {partly[0].overhead_cells} of {partly[0].n}"
                 if len(partly) == len(table.rows) and len(counts) == 1 else _timed_groups(table.rows, partly))
        notes.append("overhead from the cells that timed their own compression and prefill (the others ran before "
                     f"grids recorded it): {which}")
    if any(r.overhead_pct < 0 for r in table.rows):
        notes.append("a negative overhead means the policy's cells and the full cells were timed in different runs "
                     "(a resumed or extended grid): there the figure is run-to-run prefill noise, not the "
                     "compression's cost")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _timed_groups(rows: Sequence[HeadlineRow], partly: Sequence[HeadlineRow]) -> str:
    """``partly`` grouped by how many of their cells were timed: "63 of 104: full, kvzip; 12 of 19: tova @ 0.875"
    (a policy all of whose rows share a count is named once, without its ratios)."""
    rows_of = Counter(r.policy for r in rows)
    groups: dict[tuple[int, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in partly:
        groups[(r.overhead_cells, r.n)][r.policy].append(r.ratio)
    parts = []
    for (cells, n), policies in groups.items():
        names = [p if len(rs) == rows_of[p] else f"{p} @ {', '.join(f'{x:g}' for x in rs)}"
                 for p, rs in policies.items()]
        parts.append(f"{cells} of {n}: " + ", ".join(names))
    return "; ".join(parts)


def format_comparisons(comparisons: Sequence[Comparison], digits: int = 1) -> str:
    """Markdown table of paired differences, one row per comparison."""
    lines = ["| A | B | ratio | n | A - B | 95% CI | verdict |", "|---|---|---:|---:|---:|---:|---|"]
    for c in comparisons:
        lines.append(f"| {c.a} | {c.b} | {c.ratio:g} | {c.n} | {c.diff:+.{digits}f} | "
                     f"[{c.low:+.{digits}f}, {c.high:+.{digits}f}] | {c.verdict} |")
    return "\n".join(lines) + "\n"


def headline_report(store_path: str | Path, model: str | None = None,
                    compare_pairs: Sequence[tuple[str, str]] = (), tasks: Sequence[str] | None = None,
                    resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                    allow_mixed_machines: bool = False) -> str:
    """The headline tables of a store (every model, or ``model``), each followed by ``A - B`` at every ratio
    both policies of a pair have (a full-cache side is taken at ratio 0). What ``kvsieve report --headline``
    prints."""
    path = Path(store_path)
    if not path.is_file():
        raise ValueError(f"results store {path} does not exist")
    with ResultsStore(path) as store:
        filters: dict = {"model": canonical_name(model)} if model else {}
        if tasks:
            filters["task"] = list(tasks)
        rows = store.rows(**filters)
        if not rows:
            held = sorted({k.model for k in store.keys()})
            raise ValueError(f"results store {path} holds no rows" + (f" for model {model}" if model else "")
                             + (f" and tasks {', '.join(tasks)}" if tasks else "")
                             + f"; models held: {', '.join(held) or 'none'}")
    parts = [f"Means over requests (task, length, sample) with 95% percentile-bootstrap intervals "
             f"({resamples} resamples, seed {seed}); every policy paired with the full cache on the same requests."]
    compared: set[tuple[str, str]] = set()
    problems: dict[tuple[str, str], list[str]] = defaultdict(list)
    for table in headline(rows, resamples, seed, allow_mixed_machines):
        parts.append(format_headline(table))
        group = [r for r in rows if r.key.model == table.model and int(r.key.length) == table.length
                 and layout_of(r.key.task) == table.layout]
        cells = _group(group)[(table.model, table.length)]
        comparisons, notes = [], []
        for a, b in compare_pairs:
            try:
                la, lb = _resolve(cells, a, table.model), _resolve(cells, b, table.model)
            except ValueError as err:  # a pair one table lacks is noted; one no table has is an error below
                notes.append(f"{a} vs {b}: not in this table ({str(err).split('; available')[0]})")
                problems[(a, b)].append(str(err))
                continue
            ratios = _pair_ratios(cells, la, lb)
            comparisons += [compare(group, la, lb, r, resamples=resamples, seed=seed,
                                    allow_mixed_machines=allow_mixed_machines) for r in ratios]
            if not ratios:
                notes.append(f"{la} vs {lb}: no ratio in common")
                problems[(a, b)].append(f"no ratio in common for model {table.model}")
            else:
                compared.add((a, b))
        if comparisons or notes:
            parts.append(f"Paired differences ({table.model} at {table.length} tokens):\n\n"
                         + (format_comparisons(comparisons) if comparisons else "")
                         + "".join(f"\n{note}\n" for note in notes))
    never = [f"{a} vs {b} ({'; '.join(problems[(a, b)])})" for a, b in compare_pairs if (a, b) not in compared]
    if never:
        raise ValueError(f"cannot compare in {path}: {', '.join(never)}")
    return "\n\n".join(parts)
