"""Tables and plots from stored cells (the list :meth:`ResultsStore.rows` returns).

Policy names are rendered with ``+qa`` appended when the cell's key is question-aware. Reference policies
(names starting with ``oracle`` or ending with ``+qa``) are drawn dashed. The full-cache policy ``full`` is
evaluated only at ratio 0; it is drawn as a horizontal dashed line and shown as a column in every ratio's table.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvsieve.harness.store import RATIO_DECIMALS, CellResult

__all__ = ["FULL", "display_policy", "is_reference", "score_table", "format_table", "format_summary",
           "plot_scores", "plot_task_panels"]

FULL = "full"
MISSING = "-"

# table[ratio][task][policy] = (mean score, number of cells)
ScoreTable = dict[float, dict[str, dict[str, tuple[float, int]]]]


def display_policy(policy: str, question_aware: bool) -> str:
    """The name a policy is shown under: ``+qa`` appended for question-aware cells."""
    return f"{policy}+qa" if question_aware and not policy.endswith("+qa") else policy


def is_reference(name: str) -> bool:
    """Reference (not deployable) policies: oracles and question-aware variants."""
    return name.startswith("oracle") or name.endswith("+qa")


def _policy_order(names: Iterable[str]) -> list[str]:
    """``full`` first, then ordinary policies, then reference policies, each group alphabetical."""
    return sorted(set(names), key=lambda n: (n != FULL, is_reference(n), n))


def score_table(results: Iterable[CellResult]) -> ScoreTable:
    """Mean score per ratio -> task -> policy, as ``(mean, n)``. Ratios are rounded to 6 decimals."""
    sums: dict[tuple[float, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for r in results:
        k = r.key
        acc = sums[(round(float(k.ratio), RATIO_DECIMALS), k.task, display_policy(k.policy, k.question_aware))]
        acc[0] += float(r.score)
        acc[1] += 1
    table: ScoreTable = {}
    for (ratio, task, policy), (total, n) in sorted(sums.items()):
        table.setdefault(ratio, {}).setdefault(task, {})[policy] = (total / n, n)
    return table


def _full_reference(table: ScoreTable) -> dict[str, tuple[float, int]]:
    """Per-task ``full`` scores, taken from the lowest ratio where ``full`` was evaluated (normally 0)."""
    for ratio in sorted(table):
        cells = {task: row[FULL] for task, row in table[ratio].items() if FULL in row}
        if cells:
            return cells
    return {}


def _columns(table: ScoreTable, ratio: float) -> tuple[list[str], list[str], dict[str, dict[str, float]]]:
    """Tasks (all tasks in the table), policies (those at ``ratio`` plus ``full``) and task -> policy -> mean."""
    tasks = sorted({task for by_task in table.values() for task in by_task})
    cells: dict[str, dict[str, float]] = {task: {} for task in tasks}
    for task, (mean, _) in _full_reference(table).items():
        cells[task][FULL] = mean
    for task, by_policy in table.get(ratio, {}).items():
        for policy, (mean, _) in by_policy.items():
            cells[task][policy] = mean
    policies = _policy_order(p for row in cells.values() for p in row)
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
    lines += [f"| {p} | " + " | ".join(rows[p]) + " |" for p in _policy_order(rows)]
    return "\n".join(lines) + "\n"


# -- plots ----------------------------------------------------------------------------------------------------


def _curves(table: ScoreTable, tasks: Sequence[str]) -> dict[str, list[tuple[float, float]]]:
    """policy -> [(ratio, score)] where score is the task's mean (one task) or the average over ``tasks``
    (a point only where the policy covers every task). ``full`` is excluded (it is a reference line)."""
    curves: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for ratio in sorted(table):
        by_task = table[ratio]
        names = {p for t in tasks for p in by_task.get(t, {})} - {FULL}
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


def _draw(ax, table: ScoreTable, tasks: Sequence[str], colors: dict[str, str]) -> None:
    for policy, points in sorted(_curves(table, tasks).items(), key=lambda kv: (is_reference(kv[0]), kv[0])):
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, label=policy, color=colors[policy],
                linestyle="--" if is_reference(policy) else "-")
    level = _full_level(table, tasks)
    if level is not None:
        ax.axhline(level, color="black", linestyle="--", linewidth=1, label=FULL)
    ax.set_xlabel("compression ratio")
    ax.grid(True, alpha=0.3)


def _prepare(results: Iterable[CellResult]) -> tuple[ScoreTable, list[str], dict[str, str]]:
    table = score_table(results)
    if not table:
        raise ValueError("no results to plot")
    tasks = sorted({task for by_task in table.values() for task in by_task})
    policies = _policy_order({p for by_task in table.values() for row in by_task.values() for p in row} - {FULL})
    palette = [f"C{i}" for i in range(10)]
    colors = {p: palette[i % len(palette)] for i, p in enumerate(policies)}
    return table, tasks, colors


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
    """PNG of the average score (over tasks) vs compression ratio, one line per policy."""
    table, tasks, colors = _prepare(results)
    fig = _figure((7, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    _draw(ax, table, tasks, colors)
    ax.set_ylabel("average score")
    ax.set_title(title or f"average over {len(tasks)} task{'s' if len(tasks) != 1 else ''}")
    ax.legend(fontsize="small", loc="best")
    return _save(fig, path)


def plot_task_panels(results: Iterable[CellResult], path: str | Path, ncols: int = 3) -> Path:
    """PNG with one subplot per task: score vs compression ratio, one line per policy."""
    table, tasks, colors = _prepare(results)
    ncols = max(1, min(ncols, len(tasks)))
    nrows = math.ceil(len(tasks) / ncols)
    fig = _figure((4.2 * ncols, 3.3 * nrows + 0.6))
    handles: dict[str, object] = {}
    for i, task in enumerate(tasks):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        _draw(ax, table, [task], colors)
        ax.set_title(task)
        if i % ncols == 0:
            ax.set_ylabel("score")
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    labels = _policy_order(handles)
    fig.legend([handles[label] for label in labels], labels, loc="lower center", ncol=min(len(labels), 6),
               fontsize="small", bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.08 if nrows == 1 else 0.05, 1, 1))
    return _save(fig, path)
