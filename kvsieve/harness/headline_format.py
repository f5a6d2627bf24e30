"""The headline tables and paired comparisons as Markdown (what ``kvsieve report --headline`` prints)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

from kvsieve.harness.headline_tables import Comparison, Headline, HeadlineRow

__all__ = ["format_comparisons", "format_headline"]


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
