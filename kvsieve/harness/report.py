"""Score tables from stored cells (the list :meth:`ResultsStore.rows` returns); their plots are ``report_plots.py``.

A table shows one model: rows of several models are refused (split them with :func:`by_model`; :func:`report_text`
does it for a whole store), and every heading names the model and the number of requests (task, length, sample)
behind it.

Policy names are the labels' display form (:class:`~kvsieve.policies.label.Point`: ``+qa`` appended when the cell's key
is question-aware); what each is (reference or not, its place in a table) is read from its rows' points
(:attr:`ScoreTable.points`), never from the name's text. Reference policies (a family whose class says ``is_reference``,
the answer-span oracle, and question-aware rows) are drawn dashed in the plots. The full-cache policy ``full`` is
evaluated only at ratio 0; it is shown as a column in every ratio's table.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from kvsieve.harness.pairing import display_label, reference_key
from kvsieve.harness.provenance import check_one_machine, describe
from kvsieve.harness.store import RATIO_DECIMALS, CellResult, FailedCell
from kvsieve.policies.label import FULL_CACHE, Point, display_order

__all__ = ["ScoreTable", "by_model", "one_model", "full_reference", "score_table", "format_table",
           "format_summary", "format_failures", "report_text", "requests"]

MISSING = "-"

FULL_POINT = Point(FULL_CACHE)  # the full cache at prefill: the reference whose scores every ratio's table shows


class ScoreTable(dict[float, dict[str, dict[str, tuple[float, int]]]]):
    """``table[ratio][task][policy] = (mean score, number of cells)``, and :attr:`points`: each policy's (display
    label's) point, as its rows' keys hold it."""

    def __init__(self, *args, points: dict[str, Point] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.points: dict[str, Point] = dict(points or {})


def by_model(results: Iterable[CellResult]) -> dict[str, list[CellResult]]:
    """The rows of each model, models in alphabetical order (rows keep their order)."""
    groups: dict[str, list[CellResult]] = defaultdict(list)
    for r in results:
        groups[r.key.model].append(r)
    return dict(sorted(groups.items()))


def one_model(results: Iterable[CellResult]) -> tuple[list[CellResult], str | None]:
    """The rows as a list and their model; ``ValueError`` naming the models if there are several."""
    rows = list(results)
    models = sorted({r.key.model for r in rows})
    if len(models) > 1:
        raise ValueError(f"rows of {len(models)} models ({', '.join(models)}): a table or plot never pools models; "
                         "split them with kvsieve.harness.report.by_model (or filter the store by model)")
    return rows, (models[0] if models else None)


def requests(results: Iterable[CellResult]) -> int:
    """The number of distinct requests (task, length, sample) among ``results``."""
    return len({(r.key.task, int(r.key.length), r.key.sample_id) for r in results})


def score_table(results: Iterable[CellResult]) -> ScoreTable:
    """Mean score per ratio -> task -> policy, as ``(mean, n)``. Ratios are rounded to 6 decimals.
    The rows must be of one model (``ValueError`` otherwise)."""
    results, _ = one_model(results)
    sums: dict[tuple[float, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    table = ScoreTable()
    for r in results:
        k = r.key
        label = display_label(k)
        table.points.setdefault(label, k.point)
        acc = sums[(round(float(k.ratio), RATIO_DECIMALS), k.task, label)]
        acc[0] += float(r.score)
        acc[1] += 1
    for (ratio, task, policy), (total, n) in sorted(sums.items()):
        table.setdefault(ratio, {}).setdefault(task, {})[policy] = (total / n, n)
    return table


def full_reference(table: ScoreTable) -> dict[str, tuple[float, int]]:
    """Per-task ``full`` scores, from the rows :func:`~kvsieve.harness.pairing.reference_key` names (the lowest ratio
    where ``full`` was evaluated, normally 0)."""
    keys = {(policy, ratio) for ratio, by_task in table.items() for row in by_task.values() for policy in row}
    key = reference_key(keys, FULL_POINT)
    if key is None:
        return {}
    name, ratio = key
    return {task: row[name] for task, row in table[ratio].items() if name in row}


def _columns(table: ScoreTable, ratio: float) -> tuple[list[str], list[str], dict[str, dict[str, float]]]:
    """Tasks (all tasks in the table), policies (those at ``ratio`` plus ``full``) and task -> policy -> mean."""
    tasks = sorted({task for by_task in table.values() for task in by_task})
    cells: dict[str, dict[str, float]] = {task: {} for task in tasks}
    for task, (mean, _) in full_reference(table).items():
        cells[task][FULL_CACHE] = mean
    for task, by_policy in table.get(ratio, {}).items():
        for policy, (mean, _) in by_policy.items():
            cells[task][policy] = mean
    policies = display_order(table.points[p] for row in cells.values() for p in row)
    return tasks, policies, cells


def _average(cells: dict[str, dict[str, float]], tasks: Sequence[str], policy: str) -> float | None:
    """Average of per-task means; ``None`` unless the policy has a score on every task."""
    means = [cells[task].get(policy) for task in tasks]
    if not means or any(m is None for m in means):
        return None
    return sum(means) / len(means)


def format_table(table: ScoreTable, ratio: float, fmt: str = "text", digits: int = 3) -> str:
    """One ratio's table: tasks as rows, policies as columns (``full`` always included), then an ``average``
    row (the mean of the per-task means; ``-`` unless the policy covers every task). Missing cells are ``-``.

    ``fmt`` is ``"text"`` (aligned plain text) or ``"markdown"``.
    """
    if fmt not in ("text", "markdown"):
        raise ValueError(f"fmt must be 'text' or 'markdown', not {fmt!r}")
    ratio = round(float(ratio), RATIO_DECIMALS)
    if ratio not in table and not (ratio == 0 and full_reference(table)):
        raise KeyError(f"no results at ratio {ratio}; available ratios: {sorted(table)}")
    tasks, policies, cells = _columns(table, ratio)

    def show(value: float | None) -> str:
        return MISSING if value is None or math.isnan(value) else f"{value:.{digits}f}"

    header = ["task", *policies]
    body = [[task, *(show(cells[task].get(p)) for p in policies)] for task in tasks]
    body.append(["average", *(show(_average(cells, tasks, p)) for p in policies)])

    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * len(policies)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines) + "\n"

    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(cells).rstrip()

    lines = [line(header), "  ".join("-" * w for w in widths)]
    lines += [line(row) for row in body[:-1]]
    lines += ["  ".join("-" * w for w in widths), line(body[-1])]
    return "\n".join(lines) + "\n"


def format_summary(table: ScoreTable, digits: int = 1) -> str:
    """Markdown: one row per policy, one column per ratio, the average over tasks (``-`` unless the policy
    covers every task at that ratio); ``full`` first, with its one score under every ratio."""
    tasks = sorted({task for by_task in table.values() for task in by_task})
    ratios = [r for r in sorted(table) if r > 0]
    rows: dict[str, list[str]] = {}
    for i, ratio in enumerate(ratios):
        _, policies, cells = _columns(table, ratio)
        for policy in policies:
            value = _average(cells, tasks, policy)
            rows.setdefault(policy, [MISSING] * len(ratios))[i] = MISSING if value is None else f"{value:.{digits}f}"
    lines = ["| policy | " + " | ".join(f"{r:g}" for r in ratios) + " |", "|---|" + "---:|" * len(ratios)]
    lines += [f"| {p} | " + " | ".join(rows[p]) + " |" for p in display_order(table.points[p] for p in rows)]
    return "\n".join(lines) + "\n"


def format_failures(failures: Iterable[FailedCell], results: Iterable[CellResult] = ()) -> str:
    """Markdown: failed cells per (policy, ratio), with the cells scored beside them and the first reason. Failed
    cells have no score; the means of the other tables leave them out, and this table says how many."""
    scored: dict[tuple[str, float], int] = defaultdict(int)
    for r in results:
        scored[(display_label(r.key), round(float(r.key.ratio), RATIO_DECIMALS))] += 1
    groups: dict[tuple[str, float], list[FailedCell]] = defaultdict(list)
    points: dict[str, Point] = {}
    for f in failures:
        label = display_label(f.key)
        points.setdefault(label, f.key.point)
        groups[(label, round(float(f.key.ratio), RATIO_DECIMALS))].append(f)
    lines = ["| policy | ratio | failed | scored | first reason |", "|---|---:|---:|---:|---|"]
    for (policy, ratio), items in sorted(groups.items(), key=lambda kv: (points[kv[0][0]].sort_key, kv[0][1])):
        reason = items[0].reason.replace("|", "/")[:200]
        lines.append(f"| {policy} | {ratio:g} | {len(items)} | {scored.get((policy, ratio), 0)} | {reason} |")
    return "\n".join(lines) + "\n"


def report_text(results: Iterable[CellResult], markdown: bool = False, allow_mixed_machines: bool = False,
                failures: Iterable[FailedCell] = ()) -> str:
    """What ``kvsieve report`` prints: per model, one table per compression ratio and the summary, each
    headed with the model and its number of requests, then the line saying which machines, dtypes and
    revisions the rows came from, and the cells that failed (``failures``: no score, left out of every mean,
    counted). Empty string for no rows; ``ValueError`` where one model's rows come from several machines (its
    tables would set them side by side), unless ``allow_mixed_machines``."""
    parts = []
    results = list(results)
    failed_by_model: dict[str, list[FailedCell]] = defaultdict(list)
    for failure in failures:
        failed_by_model[failure.key.model].append(failure)
    for model, rows in by_model(results).items():
        check_one_machine([r.provenance for r in rows], f"the {model} tables", allow_mixed_machines)
        table, n = score_table(rows), requests(rows)
        for ratio in sorted(table):
            if ratio > 0:
                parts.append(f"## compression ratio {ratio:g} ({model}, n = {n} requests)\n\n"
                             + format_table(table, ratio, fmt="markdown" if markdown else "text"))
        parts.append(f"## average over tasks, by compression ratio ({model}, n = {n} requests)\n\n"
                     + format_summary(table) + f"\nrows from: {describe(r.provenance for r in rows)}\n")
        if model in failed_by_model:
            parts.append(_failures_part(model, failed_by_model.pop(model), rows))
    for model, items in sorted(failed_by_model.items()):  # models with failed cells and no scored one
        parts.append(_failures_part(model, items, []))
    return "\n".join(parts)


def _failures_part(model: str, failures: list[FailedCell], rows: list[CellResult]) -> str:
    return (f"## failed cells ({model}): {len(failures)}, not in any mean above (no score; a rerun retries them)\n\n"
            + format_failures(failures, rows))
