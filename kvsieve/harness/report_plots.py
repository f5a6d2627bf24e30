"""Plots from stored cells: score against compression ratio, one line per policy, for one model.

Like the tables (``report.py``), a plot shows one model (rows of several are refused; :func:`write_plots` splits a
whole store) and its title names the model and the number of requests behind it. Each policy's line has its own
colour x line style x marker (70 ordinary lines before a combination repeats), reference policies are dashed, the
full cache is a horizontal dashed line, and legends sit outside the axes.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvsieve.harness.report import ScoreTable, by_model, full_reference, one_model, requests, score_table
from kvsieve.harness.store import CellResult
from kvsieve.policies.label import FULL_CACHE, Point, display_order

__all__ = ["line_styles", "plot_scores", "plot_task_panels", "scores_figure", "task_panels_figure", "write_plots"]


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
    ref = full_reference(table)
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


def line_styles(points: Iterable[Point]) -> dict[str, Style]:
    """A distinct (colour, line style, marker) per policy (its points' display label), in
    :func:`~kvsieve.policies.label.display_order`; reference policies dashed."""
    points = list(points)
    reference = {p.display for p in points if p.is_reference}
    styles: dict[str, Style] = {}
    for i, policy in enumerate(display_order(points)):
        linestyle = _REFERENCE_STYLE if policy in reference else _LINESTYLES[(i // len(_COLORS)) % len(_LINESTYLES)]
        styles[policy] = (_COLORS[i % len(_COLORS)], linestyle, _MARKERS[i % len(_MARKERS)])
    return styles


def _draw(ax, table: ScoreTable, tasks: Sequence[str], styles: dict[str, Style]) -> None:
    for policy, points in sorted(_curves(table, tasks).items(),
                                 key=lambda kv: (table.points[kv[0]].is_reference, kv[0])):
        xs, ys = zip(*points, strict=True)
        color, linestyle, marker = styles[policy]
        ax.plot(xs, ys, marker=marker, markersize=4, label=policy, color=color, linestyle=linestyle, linewidth=1.2)
    level = _full_level(table, tasks)
    if level is not None:
        ax.axhline(level, color="black", linestyle="--", linewidth=1, label=FULL_CACHE)
    ax.set_xlabel("compression ratio")
    ax.grid(True, alpha=0.3)


def _prepare(results: Iterable[CellResult]) -> tuple[ScoreTable, list[str], dict[str, Style], str, int]:
    rows, model = one_model(results)
    table = score_table(rows)
    if not table:
        raise ValueError("no results to plot")
    tasks = sorted({task for by_task in table.values() for task in by_task})
    names = {p for by_task in table.values() for row in by_task.values() for p in row} - {FULL_CACHE}
    styles = line_styles(table.points[p] for p in names)
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
    labels = display_order(table.points[label] for label in handles)
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
