"""``kvsieve report --headline``: a store's rows read, every model's headline tables and the asked paired
differences at every ratio both sides have, as Markdown.

The statistics are :mod:`kvsieve.harness.headline_tables` (grouping and the full-cache reference:
:mod:`kvsieve.harness.pairing`; intervals: :mod:`kvsieve.bootstrap`), the rendering
:mod:`kvsieve.harness.headline_format`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from kvsieve.bootstrap import DEFAULT_RESAMPLES, DEFAULT_SEED
from kvsieve.bundled import canonical_name
from kvsieve.harness.headline_format import format_comparisons, format_headline
from kvsieve.harness.headline_tables import compare, headline
from kvsieve.harness.pairing import group_cells, layout_of, pair_ratios, resolve_label
from kvsieve.harness.store import read_stores

__all__ = ["headline_report"]


def headline_report(stores: Sequence[str | Path], model: str | None = None,
                    compare_pairs: Sequence[tuple[str, str]] = (), tasks: Sequence[str] | None = None,
                    resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                    allow_mixed_machines: bool = False) -> str:
    """The headline tables of one store, or of several pooled (every model, or ``model``), each followed by
    ``A - B`` at every ratio both policies of a pair have (a full-cache side is taken at ratio 0). What
    ``kvsieve report --headline`` prints."""
    filters: dict = {"model": canonical_name(model)} if model else {}
    if tasks:
        filters["task"] = list(tasks)
    rows, _ = read_stores(stores, **filters)
    if not rows:
        held = sorted({r.key.model for r in read_stores(stores)[0]})
        raise ValueError(f"results store {', '.join(map(str, stores))} holds no rows"
                         + (f" for model {model}" if model else "")
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
        cells = group_cells(group)[(table.model, table.length)]
        comparisons, notes = [], []
        for a, b in compare_pairs:
            try:
                la, lb = resolve_label(cells, a, table.model), resolve_label(cells, b, table.model)
            except ValueError as err:  # a pair one table lacks is noted; one no table has is an error below
                notes.append(f"{a} vs {b}: not in this table ({str(err).split('; available')[0]})")
                problems[(a, b)].append(str(err))
                continue
            ratios = pair_ratios(cells, la, lb)
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
        raise ValueError(f"cannot compare in {', '.join(map(str, stores))}: {', '.join(never)}")
    return "\n\n".join(parts)
