"""Migrating a results store: each row's point stored in structured form, and rows a store holds under a path to a
named program or checkpoint moved to the name's key.

Points: a store written before rows kept their point (schema 1) gets each row's point derived once from its key's
text and stored in the point columns (:meth:`~kvsieve.harness.store.ResultsStore.store_points`); from then on every
report reads the points the store hands back and no label's text. Figures and labels do not change.

Names: a row is keyed by its policy spec's text. Since programs and checkpoints have names
(``kvsieve/language/shipped_programs.py``, ``kvsieve/networks/shipped.py``), a spec giving a file by the path of a
named one's bytes is keyed by the name (:func:`kvsieve.policies.registry.parse`), and rows stored before under the
path would no longer meet it. :func:`migrate` renames them: each stored label is parsed as a grid would parse it now
(paths relative to the working directory, as when they were stored), and a label whose text changes has its rows
renamed when every one was computed from the named file's bytes (its ``policy_digest``). Rows of other bytes (or of
none recorded), and labels whose files are gone, keep their keys and are listed. Figures do not change: only the key
column and each row's record of its point (``config.cell.policy``, and ``config.renamed_from``) are rewritten.

    python -m kvsieve.harness.migrate [--dry-run] STORE.sqlite ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsieve.harness.store import ResultsStore
from kvsieve.policies.label import Point
from kvsieve.policies.registry import parse

__all__ = ["Rename", "main", "migrate", "store_points"]


@dataclass(frozen=True)
class Rename:
    """A stored label, the label it is stored under now (None: kept, ``why``), and its rows."""

    old: str
    new: str | None
    rows: int
    why: str = ""


def _plan(store: ResultsStore) -> list[Rename]:
    labels = {k.policy: k.point for k in store.keys()}
    labels.update({f.key.policy: f.key.point for f in store.failed() if f.key.policy not in labels})
    plan = []
    for label, point in labels.items():
        try:
            spec = parse(point.spec)
        except ValueError as err:  # its file is gone, or was never here: nothing to compare with
            plan.append(Rename(label, None, store.count(policy=label), f"not parsed here: {err}"))
            continue
        if spec.text == point.spec:
            continue
        new = Point(spec.text, mode=point.mode).stored
        digests = {row.config.get("policy_digest") for row in store.rows(policy=label)}
        if digests - {spec.digest}:
            other = ", ".join(sorted(d[:12] if d else "unrecorded" for d in digests - {spec.digest}))
            plan.append(Rename(label, None, store.count(policy=label),
                               f"rows computed from other bytes than {spec.text}'s (sha256 {other}; "
                               f"the name's {(spec.digest or '')[:12]})"))
            continue
        plan.append(Rename(label, new, store.count(policy=label)))
    return plan


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"results store {path} does not exist")
    return path


def store_points(path: str | Path, apply: bool = True) -> int:
    """Store the point of every row of the store ``path`` that does not yet keep it in structured form, read once from
    its key's text (``apply=False``: only count them). Returns the rows and failed cells given, or to be given, their
    point (0 for a migrated store)."""
    with ResultsStore(_existing(path)) as store:
        return store.store_points() if apply else store.unstored_points()


def migrate(path: str | Path, apply: bool = True) -> list[Rename]:
    """Migrate the store ``path``: every row's point stored in structured form (:func:`store_points`), then the stored
    labels that a named program or checkpoint now keys renamed (``apply=False``: only say which, changing nothing).
    Returns every label renamed, or to be, and every one kept with its reason."""
    path = _existing(path)
    with ResultsStore(path) as store:
        if apply:
            store.store_points()
        plan = _plan(store)
        if apply:
            store.rename_policies({r.old: r.new for r in plan if r.new is not None})
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsieve.harness.migrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("stores", nargs="+", help="results stores (SQLite) to migrate in place")
    parser.add_argument("--dry-run", action="store_true", help="say what would be migrated; change nothing")
    args = parser.parse_args(argv)
    for store in args.stores:
        points = store_points(store, apply=False)
        plan = migrate(store, apply=not args.dry_run)
        print(f"{store}: {'would store' if args.dry_run else 'stored'} the point of {points} row(s) in structured form"
              + (" (every row keeps its point already)" if not points else ""))
        done = [r for r in plan if r.new is not None]
        verb = "would rename" if args.dry_run else "renamed"
        print(f"{store}: {verb} {len(done)} label(s), {sum(r.rows for r in done)} rows")
        for r in plan:
            print(f"  {r.old} -> {r.new} ({r.rows} rows)" if r.new else f"  kept {r.old} ({r.rows} rows): {r.why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
