"""Rows grouped for pairing: per (model, length), per (display label, ratio), per request; and which rows are a
label's full-cache reference.

A *request* is one ``(task, length, sample_id)``. Rows of different models, lengths or prompt layouts
(``tasks/ruler_alt.py``'s ``fmt2:`` tasks) are never pooled. A label's reference is its full-cache label
(``full``, or ``full@decodeN`` for decode-time rows: :attr:`~kvsieve.policies.label.Point.reference`) at the lowest
ratio it was stored at (normally 0): :func:`reference_key` is the one lookup of it, for the headline tables and the
report's tables alike.

What a label is (full cache, reference, its reference, its order) is read from its rows' points, which the store hands
back (:attr:`~kvsieve.harness.store.CellKey.point`; :attr:`Cells.points`), never from the label's text. Only a name a
user gives (``--compare``) is read as text, to find a file it names (:func:`resolve_label`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from kvsieve.harness.store import RATIO_DECIMALS, CellKey, CellResult
from kvsieve.policies.label import Point, display_order
from kvsieve.policies.registry import parse
from kvsieve.tasks.ruler_alt import PREFIX as ALT_PREFIX
from kvsieve.tasks.ruler_alt import is_alt_task

__all__ = ["Cells", "Request", "by_layout", "display_label", "group_cells", "layout_of", "pair_ratios",
           "reference_cells", "reference_key", "resolve_label"]

Request = tuple[str, int, str]  # (task, length, sample_id)


class Cells(dict[tuple[str, float], dict[Request, CellResult]]):
    """(display label, ratio) -> request -> cell, and :attr:`points`: each display label's point, as its rows' keys
    hold it (the store's structured point; any ratio: what a label is does not depend on it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.points: dict[str, Point] = {}


def layout_of(task: str) -> str:
    """Which prompt layout a task's samples use: ``fmt2`` (``tasks/ruler_alt.py``) or ``""`` (every other)."""
    return ALT_PREFIX.rstrip(":") if is_alt_task(task) else ""


def by_layout(rows: Iterable[CellResult]) -> dict[str, list[CellResult]]:
    """Rows split by layout: each layout gets its own tables, never one mean over both."""
    parts: dict[str, list[CellResult]] = defaultdict(list)
    for r in rows:
        parts[layout_of(r.key.task)].append(r)
    return parts


def display_label(key: CellKey) -> str:
    """The name a stored row is shown under: its point's display form (``+qa`` when question-aware)."""
    return key.point.display


def group_cells(rows: Iterable[CellResult]) -> dict[tuple[str, int], Cells]:
    """(model, length) -> (display label, ratio) -> request -> cell. Rows of different models never mix."""
    groups: dict[tuple[str, int], Cells] = defaultdict(Cells)
    for r in rows:
        k = r.key
        cells, label = groups[(k.model, int(k.length))], display_label(k)
        cells.setdefault((label, round(float(k.ratio), RATIO_DECIMALS)), {})[(k.task, int(k.length), k.sample_id)] = r
        cells.points.setdefault(label, k.point)
    return groups


def reference_key(keys: Iterable[tuple[str, float]], point: Point) -> tuple[str, float] | None:
    """Among ``(display label, ratio)`` keys, the one holding the full-cache rows ``point``'s rows are paired with:
    its reference label at the lowest ratio stored (normally 0); None when there is none."""
    ref = point.reference.display
    ratios = sorted(ratio for name, ratio in keys if name == ref)
    return (ref, ratios[0]) if ratios else None


def reference_cells(cells: Cells, label: str) -> dict[Request, CellResult]:
    """The full-cache cells ``label``'s rows are paired with (:func:`reference_key`); empty when none."""
    key = reference_key(cells, cells.points[label])
    return cells[key] if key is not None else {}


def resolve_label(cells: Cells, name: str, model: str) -> str:
    """A display label for ``name`` (a user's text): exact (``oracle+qa``), or a stored label held under one display
    label only (``snapkv`` for ``snapkv+qa``), or a named program or checkpoint given by a file's path."""
    labels = {label for label, _ in cells}
    if name in labels:
        return name
    matches = {label for label in labels if cells.points[label].stored == name}
    if len(matches) == 1:
        return matches.pop()
    named = _named(name)
    if not matches and named is not None:  # a file by path whose rows are keyed by its name
        try:
            return resolve_label(cells, named, model)
        except ValueError:
            pass
    problem = "has no rows" if not matches else f"is ambiguous ({', '.join(sorted(matches))})"
    raise ValueError(f"policy {name!r} {problem} for model {model}; available: "
                     f"{', '.join(display_order(cells.points[label] for label in labels))}")


def _named(name: str) -> str | None:
    """The label ``name`` is stored under when it gives a named program or checkpoint by a file's path (the file is
    read); None when it is stored as written, or is no spec here. ``name`` is a user's text (``--compare``): the one
    label read as text here (input, not a stored row)."""
    try:
        point = Point.parse(name)
        text = parse(point.spec).text
    except ValueError:
        return None
    if text == point.spec:
        return None
    return Point(text, point.ratio, point.question_aware, point.mode).display


def pair_ratios(cells: Cells, a: str, b: str) -> list[float]:
    """The ratios a pair can be compared at: both sides' common ratios; a full-cache side fits every ratio."""
    def ratios(label: str) -> set[float]:
        return {r for name, r in cells if name == label}

    full_a, full_b = cells.points[a].is_full, cells.points[b].is_full
    if full_a and full_b:
        return [0.0]
    return sorted(ratios(b) if full_a else ratios(a) if full_b else ratios(a) & ratios(b))
