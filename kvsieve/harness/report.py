"""Tables and plots from stored cells (the list :meth:`ResultsStore.rows` returns).

A table or plot shows one model: rows of several models are refused (split them with :func:`by_model`;
:func:`report_text` and :func:`write_plots` do it for a whole store), and every title names the model and
the number of requests (task, length, sample) behind it. Each policy's line has its own colour x line
style x marker (70 ordinary lines before a combination repeats) and legends sit outside the axes.

Policy names are the labels' display form (:class:`~kvsieve.policies.label.Label`: ``+qa`` appended when the
cell's key is question-aware). Reference policies (a family whose class says ``is_reference``, the answer-span
oracle, and question-aware rows) are drawn dashed. The full-cache policy ``full`` is evaluated only at ratio 0;
it is drawn as a horizontal dashed line and shown as a column in every ratio's table.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvsieve.harness.pairing import display_label, reference_key
from kvsieve.harness.provenance import check_one_machine, describe
from kvsieve.harness.store import RATIO_DECIMALS, CellResult, FailedCell
from kvsieve.policies.label import FULL_CACHE, Label, display_order

__all__ = ["by_model", "line_styles", "score_table", "format_table",
           "format_summary", "format_failures", "plot_scores", "plot_task_panels", "report_text", "requests",
           "scores_figure", "task_panels_figure", "write_plots"]

MISSING = "-"

# table[ratio][task][policy] = (mean score, number of cells)
ScoreTable = dict[float, dict[str, dict[str, tuple[float, int]]]]


def _is_reference(name: str) -> bool:
    return Label.parse(name).is_reference


def by_model(results: Iterable[CellResult]) -> dict[str, list[CellResult]]:
    """The rows of each model, models in alphabetical order (rows keep their order)."""
    groups: dict[str, list[CellResult]] = defaultdict(list)
    for r in results:
        groups[r.key.model].append(r)
    return dict(sorted(groups.items()))


def _one_model(results: Iterable[CellResult]) -> tuple[list[CellResult], str | None]:
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
    results, _ = _one_model(results)
    sums: dict[tuple[float, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for r in results:
        k = r.key
        acc = sums[(round(float(k.ratio), RATIO_DECIMALS), k.task, display_label(k))]
        acc[0] += float(r.score)
        acc[1] += 1
    table: ScoreTable = {}
    for (ratio, task, policy), (total, n) in sorted(sums.items()):
        table.setdefault(ratio, {}).setdefault(task, {})[policy] = (total / n, n)
    return table


def _full_reference(table: ScoreTable) -> dict[str, tuple[float, int]]:
    """Per-task ``full`` scores, from the rows :func:`~kvsieve.harness.pairing.reference_key` names (the lowest ratio
    where ``full`` was evaluated, normally 0)."""
    keys = {(policy, ratio) for ratio, by_task in table.items() for row in by_task.values() for policy in row}
    key = reference_key(keys, FULL_CACHE)
    if key is None:
        return {}
    name, ratio = key
    return {task: row[name] for task, row in table[ratio].items() if name in row}


def _columns(table: ScoreTable, ratio: float) -> tuple[list[str], list[str], dict[str, dict[str, float]]]:
    """Tasks (all tasks in the table), policies (those at ``ratio`` plus ``full``) and task -> policy -> mean."""
    tasks = sorted({task for by_task in table.values() for task in by_task})
    cells: dict[str, dict[str, float]] = {task: {} for task in tasks}
    for task, (mean, _) in _full_reference(table).items():
        cells[task][FULL_CACHE] = mean
    for task, by_policy in table.get(ratio, {}).items():
        for policy, (mean, _) in by_policy.items():
            cells[task][policy] = mean
    policies = display_order(p for row in cells.values() for p in row)
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
    if ratio not in table and not (ratio == 0 and _full_reference(table)):
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
    lines += [f"| {p} | " + " | ".join(rows[p]) + " |" for p in display_order(rows)]
    return "\n".join(lines) + "\n"


# -- plots ----------------------------------------------------------------------------------------------------


def _curves(table: ScoreTable, tasks: Sequence[str]) -> dict[str, list[tuple[float, float]]]:
    """policy -> [(ratio, score)] where score is the task's mean (one task) or the average over ``tasks``
    (a point only where the policy covers every task). ``full`` is excluded (it is a reference line)."""
    curves: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for ratio in sorted(table):
        by_task = table[ratio]
        names = {p for t in tasks for p in by_task.get(t, {})} - {FULL_CACHE}
        for policy in names:
            means = [by_task.get(t, {}).get(policy) for t in tasks]
            if all(m is not None for m in means):
                curves[policy].append((ratio, sum(m[0] for m in means) / len(means)))
    return dict(curves)


def _full_level(table: ScoreTable, tasks: Sequence[str]) -> float | None:
    ref = _full_reference(table)
    if not tasks or any(t not in ref for t in tasks):
        return None
    return sum(ref[t][0] for t in tasks) / len(tasks)


# 10 colours and 7 markers (coprime: the pair repeats after 70 lines), 3 line styles for ordinary policies
# by tens; reference policies are dashed
_COLORS = tuple(f"C{i}" for i in range(10))
_MARKERS = ("o", "s", "^", "v", "D", "P", "X")
_LINESTYLES = ("-", "-.", ":")
_REFERENCE_STYLE = "--"

Style = tuple[str, str, str]  # (colour, line style, marker)


def line_styles(policies: Iterable[str]) -> dict[str, Style]:
    """A distinct (colour, line style, marker) per policy, in :func:`~kvsieve.policies.label.display_order`;
    reference policies dashed."""
    styles: dict[str, Style] = {}
    for i, policy in enumerate(display_order(policies)):
        linestyle = _REFERENCE_STYLE if _is_reference(policy) else _LINESTYLES[(i // len(_COLORS)) % len(_LINESTYLES)]
        styles[policy] = (_COLORS[i % len(_COLORS)], linestyle, _MARKERS[i % len(_MARKERS)])
    return styles


def _draw(ax, table: ScoreTable, tasks: Sequence[str], styles: dict[str, Style]) -> None:
    for policy, points in sorted(_curves(table, tasks).items(), key=lambda kv: (_is_reference(kv[0]), kv[0])):
        xs, ys = zip(*points, strict=True)
        color, linestyle, marker = styles[policy]
        ax.plot(xs, ys, marker=marker, markersize=4, label=policy, color=color, linestyle=linestyle, linewidth=1.2)
    level = _full_level(table, tasks)
    if level is not None:
        ax.axhline(level, color="black", linestyle="--", linewidth=1, label=FULL_CACHE)
    ax.set_xlabel("compression ratio")
    ax.grid(True, alpha=0.3)


def _prepare(results: Iterable[CellResult]) -> tuple[ScoreTable, list[str], dict[str, Style], str, int]:
    rows, model = _one_model(results)
    table = score_table(rows)
    if not table:
        raise ValueError("no results to plot")
    tasks = sorted({task for by_task in table.values() for task in by_task})
    styles = line_styles({p for by_task in table.values() for row in by_task.values() for p in row} - {FULL_CACHE})
    return table, tasks, styles, str(model), requests(rows)


LEGEND_ROWS = 36  # legend entries per column; the figure grows to fit one column


def _legend_columns(entries: int) -> int:
    return max(1, math.ceil(entries / LEGEND_ROWS))


def _figure(figsize: tuple[float, float]):
    """A matplotlib figure on the Agg canvas (no pyplot, so no global backend or GUI state is touched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120, bbox_inches="tight")
    return path


def plot_scores(results: Iterable[CellResult], path: str | Path, title: str | None = None) -> Path:
    """PNG of the average score (over tasks) vs compression ratio, one line per policy, for one model.
    The title names the model and the number of requests; ``title`` is put in front of that."""
    return _save(scores_figure(results, title), path)


def scores_figure(results: Iterable[CellResult], title: str | None = None):
    """The figure :func:`plot_scores` saves (a matplotlib ``Figure`` on the Agg canvas)."""
    table, tasks, styles, model, n = _prepare(results)
    fig = _figure((7, max(4.5, 0.2 * min(len(styles) + 1, LEGEND_ROWS))))
    ax = fig.add_subplot(1, 1, 1)
    _draw(ax, table, tasks, styles)
    ax.set_ylabel("average score")
    what = f"average over {len(tasks)} task{'s' if len(tasks) != 1 else ''}"
    ax.set_title(f"{title + ': ' if title else ''}{model}, {what}, n = {n} requests", fontsize="medium")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              ncol=_legend_columns(len(labels)))
    return fig


def plot_task_panels(results: Iterable[CellResult], path: str | Path, ncols: int = 3) -> Path:
    """PNG with one subplot per task (score vs compression ratio, one line per policy) for one model; each
    panel's title gives its task's requests, the figure's the model and all requests."""
    return _save(task_panels_figure(results, ncols), path)


def task_panels_figure(results: Iterable[CellResult], ncols: int = 3):
    """The figure :func:`plot_task_panels` saves."""
    rows = list(results)
    table, tasks, styles, model, n = _prepare(rows)
    per_task = {task: requests(r for r in rows if r.key.task == task) for task in tasks}
    ncols = max(1, min(ncols, len(tasks)))
    nrows = math.ceil(len(tasks) / ncols)
    fig = _figure((4.2 * ncols, 3.3 * nrows + 0.6))
    handles: dict[str, object] = {}
    for i, task in enumerate(tasks):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        _draw(ax, table, [task], styles)
        ax.set_title(f"{task} (n = {per_task[task]})", fontsize="medium")
        if i % ncols == 0:
            ax.set_ylabel("score")
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.suptitle(f"{model}: score by task, n = {n} requests")
    fig.tight_layout()
    labels = display_order(handles)
    fig.legend([handles[label] for label in labels], labels, loc="center left", bbox_to_anchor=(1.0, 0.5),
               fontsize="small", ncol=_legend_columns(len(labels)))
    return fig


def _slug(model: str) -> str:
    """A file-name-safe form of a model name (hub ids and folders carry slashes)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"


def write_plots(results: Iterable[CellResult], folder: str | Path) -> list[Path]:
    """``scores-MODEL.png`` and ``tasks-MODEL.png`` in ``folder`` for each model in ``results``."""
    folder = Path(folder)
    paths: list[Path] = []
    for model, rows in by_model(results).items():
        paths.append(plot_scores(rows, folder / f"scores-{_slug(model)}.png"))
        paths.append(plot_task_panels(rows, folder / f"tasks-{_slug(model)}.png"))
    return paths


def format_failures(failures: Iterable[FailedCell], results: Iterable[CellResult] = ()) -> str:
    """Markdown: failed cells per (policy, ratio), with the cells scored beside them and the first reason. Failed
    cells have no score; the means of the other tables leave them out, and this table says how many."""
    scored: dict[tuple[str, float], int] = defaultdict(int)
    for r in results:
        scored[(display_label(r.key), round(float(r.key.ratio), RATIO_DECIMALS))] += 1
    groups: dict[tuple[str, float], list[FailedCell]] = defaultdict(list)
    for f in failures:
        groups[(display_label(f.key), round(float(f.key.ratio), RATIO_DECIMALS))].append(f)
    lines = ["| policy | ratio | failed | scored | first reason |", "|---|---:|---:|---:|---|"]
    for (policy, ratio), items in sorted(groups.items(), key=lambda kv: (Label.parse(kv[0][0]).sort_key, kv[0][1])):
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
