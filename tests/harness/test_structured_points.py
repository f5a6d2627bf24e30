"""The store keeps each row's point in structured form (issue 71): rows are written with their spec and mode beside
their key, a store written before (schema 1) is read the same and migrated once (its labels read as text there and
nowhere else), and every report over a migrated store prints the same without reading a label's text
(``Point.parse`` and the store's one label reader made to fail while they run)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from kvsieve.cli import main
from kvsieve.evolve.pick import exploratory
from kvsieve.harness import store as store_module
from kvsieve.harness.headline import headline_report
from kvsieve.harness.migrate import migrate, store_points
from kvsieve.harness.report import format_failures, report_text
from kvsieve.harness.report_plots import scores_figure
from kvsieve.harness.store import (
    KEY_COLUMNS,
    POINT_COLUMNS,
    SCHEMA_VERSION,
    CellKey,
    CellResult,
    FailedCell,
    ResultsStore,
    read_stores,
)
from kvsieve.policies.label import Mode, Point
from kvsieve.recall import Recall

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
RECALL = Recall(0.05, sketch="sign", chunk=8)

# every kind of point a row is stored under: prefill, question-aware, decode (with an eviction interval), recall,
# a reference family, a family no longer registered, and the two full caches
POINTS = [Point("full"), Point("full", mode=Mode(64, 4)), Point("snapkv", 0.5), Point("snapkv", 0.75),
          Point("snapkv(window=32)", 0.5, True), Point("tova", 0.5, mode=Mode(64, 4)), Point("oracle", 0.5, True),
          Point("knorm", 0.75, mode=Mode(recall=RECALL)), Point("gone_family(x=1)", 0.5),
          Point("kvzap(checkpoint='smollm2-135m-instruct')", 0.5)]
FAILED = Point("h2o", 0.5)


def rows() -> list[CellResult]:
    out = []
    for i, sample in enumerate(f"s{j}" for j in range(6)):
        for k, point in enumerate(POINTS):
            score = 100.0 * ((i + k) % 3 != 0) if point.compresses else 100.0 * (i % 4 != 0)
            out.append(CellResult(CellKey.of(MODEL, "niah_single_1" if i % 2 else "ruler_vt", 1024, sample, point),
                                  "p", score, ["a"], 10, 100 if point.compresses else 200, 200, 1.0 + 0.1 * k, 0.5,
                                  {"dtype": "float32", "cell": point.as_dict()},
                                  provenance={"machine": "cpu A", "threads": 1, "dtype": "float32"}))
    return out


def write_new(path: Path) -> Path:
    with ResultsStore(path) as store:
        store.add_many(rows())
        store.add_failed([FailedCell(CellKey.of(MODEL, "ruler_vt", 1024, "s0", FAILED), "raised: boom")])
    return path


def write_old(path: Path, like: Path) -> Path:
    """The store ``like`` as kvsieve wrote it before rows kept their point: schema 1, no point columns."""
    with sqlite3.connect(like) as new:
        cells = [c for c in (r[1] for r in new.execute("PRAGMA table_info(cells)")) if c not in POINT_COLUMNS]
        failed = [c for c in (r[1] for r in new.execute("PRAGMA table_info(failed_cells)")) if c not in POINT_COLUMNS]
        cell_rows = new.execute(f"SELECT {', '.join(cells)} FROM cells ORDER BY id").fetchall()
        failed_rows = new.execute(f"SELECT {', '.join(failed)} FROM failed_cells ORDER BY id").fetchall()
    unique = f"UNIQUE ({', '.join(KEY_COLUMNS)})"
    with sqlite3.connect(path) as old:
        old.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        old.execute("INSERT INTO schema_version VALUES (1)")
        old.execute(f"CREATE TABLE cells (id INTEGER PRIMARY KEY, {', '.join(cells[1:])}, {unique})")
        old.execute(f"CREATE TABLE failed_cells (id INTEGER PRIMARY KEY, {', '.join(failed[1:])}, {unique})")
        old.executemany(f"INSERT INTO cells VALUES ({', '.join('?' * len(cells))})", cell_rows)
        old.executemany(f"INSERT INTO failed_cells VALUES ({', '.join('?' * len(failed))})", failed_rows)
    old.close()
    return path


def columns(path: Path, table: str = "cells") -> set[str]:
    with sqlite3.connect(path) as conn:
        out = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
    conn.close()
    return out


def stored_points(path: Path, table: str = "cells") -> list[tuple]:
    with sqlite3.connect(path) as conn:
        out = conn.execute(f"SELECT policy, ratio, question_aware, {', '.join(POINT_COLUMNS)} FROM {table} "
                           "ORDER BY id").fetchall()
    conn.close()
    return out


def reports(path: Path) -> dict[str, str]:
    """What the report verbs print of the store: the tables (text and Markdown), the headline tables with paired
    differences (by label, stored label and question-aware label), the failures, a plot's legend, the exploratory
    count of ``kvsieve pick``."""
    results, failures = read_stores([path])
    pairs = [("snapkv", "tova@decode64e4"), ("oracle+qa", "snapkv"), ("knorm@recall(fraction=0.05, chunk=8, "
             "sketch='sign')", "full"), ("tova@decode64e4", "full@decode64e4"), ("snapkv(window=32)", "snapkv")]
    fig = scores_figure(results)
    return {"text": report_text(results, failures=failures), "markdown": report_text(results, markdown=True),
            "headline": headline_report([path], compare_pairs=pairs, resamples=200),
            "failures": format_failures(failures, results),
            "legend": "\n".join(t.get_text() for t in fig.axes[0].get_legend().get_texts()),
            "exploratory": json.dumps(exploratory(path, MODEL)) if columns(path) >= set(POINT_COLUMNS) else ""}


def no_label_read(monkeypatch) -> None:
    """Reading a label's text fails from here on: ``Point.parse`` and the store's one reader of a stored label."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a label was read as text: {args}")

    monkeypatch.setattr(Point, "parse", classmethod(lambda cls, *a, **k: refuse(*a)))
    monkeypatch.setattr(store_module, "_point_of_label", refuse)


def test_a_written_row_keeps_its_point_and_reads_back_with_it(tmp_path):
    path = write_new(tmp_path / "new.sqlite")
    with ResultsStore(path) as store:
        assert store.schema_version == SCHEMA_VERSION == 2 and store.points_stored and store.unstored_points() == 0
        back = {r.key.point: r.key.point for r in store.rows()}
        assert {k.point for k in store.keys()} == set(back)
        (failed,) = store.failed()
    assert failed.key.point == FAILED
    for point in POINTS:  # every field: the spec, the ratio, question-awareness, the mode and its recall
        got = back[point.at(round(point.ratio, 6))]
        assert (got.spec, got.ratio, got.question_aware, got.mode) == (point.spec, point.ratio, point.question_aware,
                                                                        point.mode)
    recall = [r for r in stored_points(path) if r[6] is not None]
    assert {r[0] for r in recall} == {"knorm@recall(fraction=0.05, chunk=8, sketch='sign')"}
    assert json.loads(recall[0][6]) == asdict(RECALL) and recall[0][3:6] == ("knorm", 0, 1)
    assert {r[3:] for r in stored_points(path) if r[0] == "tova@decode64e4"} == {("tova", 64, 4, None)}


def test_a_key_given_another_point_than_its_label_is_refused():
    CellKey("m", "t", 1, "s0", "tova@decode64", 0.5, False, Point("tova", 0.5, mode=Mode(64)))
    with pytest.raises(ValueError, match="another point"):
        CellKey("m", "t", 1, "s0", "tova@decode64", 0.5, False, Point("tova", 0.5))
    assert CellKey("m", "t", 1, "s0", "tova@decode64", 0.5, False).point.mode == Mode(64)  # by hand: from its label


def test_an_old_store_reads_the_same_migrates_once_and_its_reports_read_no_label(tmp_path, monkeypatch):
    new = write_new(tmp_path / "new.sqlite")
    old = write_old(tmp_path / "old.sqlite", new)
    expected = reports(new)
    assert expected["exploratory"] and "knorm@recall" in expected["headline"] and "h2o" in expected["failures"]

    # read before it is migrated: the same rows, points and reports; the file is not changed
    assert not columns(old) & set(POINT_COLUMNS)
    with ResultsStore(old) as store, ResultsStore(new) as written:
        assert not store.points_stored and store.unstored_points() == len(rows()) + 1
        assert [(r.key, r.key.point.mode, r.score) for r in store.rows()] == [
            (r.key, r.key.point.mode, r.score) for r in written.rows()]
    assert {k: v for k, v in reports(old).items() if k != "exploratory"} == {
        k: v for k, v in expected.items() if k != "exploratory"}
    with pytest.raises(ValueError, match="kvsieve.harness.migrate"):  # pick reads the stored spec: migrate first
        exploratory(old, MODEL)
    assert not columns(old) & set(POINT_COLUMNS) and store_points(old, apply=False) == len(rows()) + 1

    assert [r.old for r in migrate(old) if r.new is None] == ["gone_family(x=1)"]  # no rename; the points stored
    assert stored_points(old) == stored_points(new)
    assert stored_points(old, "failed_cells") == stored_points(new, "failed_cells")
    with ResultsStore(old) as store:
        assert store.schema_version == SCHEMA_VERSION and store.points_stored
    assert store_points(old) == 0  # once

    no_label_read(monkeypatch)
    assert reports(old) == expected
    with pytest.raises(AssertionError, match="read as text"):  # what the guard catches
        CellKey("m", "t", 1, "s0", "snapkv", 0.5, False)


def test_the_report_verb_prints_the_same_before_and_after_the_migration(tmp_path, monkeypatch, capsys):
    old = write_old(tmp_path / "old.sqlite", write_new(tmp_path / "new.sqlite"))
    verbs = [["report", "--store", str(old)], ["report", "--store", str(old), "--headline", "--compare",
             "snapkv,tova@decode64e4", "--compare", "oracle+qa,snapkv"]]

    def printed() -> list[str]:
        out = []
        for argv in verbs:
            assert main(argv) == 0
            out.append(capsys.readouterr().out)
        return out

    before = printed()
    assert subprocess.run([sys.executable, "-m", "kvsieve.harness.migrate", str(old)], capture_output=True, text=True,
                          check=True, cwd=REPO).stdout.startswith(f"{old}: stored the point of {len(rows()) + 1} row")
    no_label_read(monkeypatch)
    assert printed() == before


def test_the_first_write_migrates_an_old_store(tmp_path):
    old = write_old(tmp_path / "old.sqlite", write_new(tmp_path / "new.sqlite"))
    extra = Point("tova", 0.75, mode=Mode(64, 4))
    with ResultsStore(old) as store:
        store.add(CellResult(CellKey.of(MODEL, "ruler_vt", 1024, "s9", extra), "p", 1.0, ["a"], 1, 1, 2, 0.0, 0.0, {}))
        assert store.points_stored and store.unstored_points() == 0 and store.schema_version == SCHEMA_VERSION
        assert store.rows(sample_id="s9")[0].key.point.mode == Mode(64, 4)
    assert stored_points(old)[:-1] == stored_points(tmp_path / "new.sqlite")


def test_a_label_that_is_no_point_stops_the_migration_with_nothing_changed(tmp_path):
    old = write_old(tmp_path / "old.sqlite", write_new(tmp_path / "new.sqlite"))
    with sqlite3.connect(old) as conn:
        conn.execute("UPDATE cells SET policy = 'snapkv@decodeX' WHERE id = 1")
    conn.close()
    with pytest.raises(ValueError, match="snapkv@decodeX"):
        migrate(old)
    assert not columns(old) & set(POINT_COLUMNS) and not columns(old, "failed_cells") & set(POINT_COLUMNS)
    with ResultsStore(old) as store:
        assert store.schema_version == 1


def test_the_tracked_stores_keep_their_points():
    """Every results store under results/ is migrated: schema 2, and each row's stored point is its label's."""
    stores = sorted((REPO / "results").glob("*.sqlite"))
    assert len(stores) >= 10
    for path in stores:
        db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
        assert db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == SCHEMA_VERSION, path.name
        stored = db.execute(f"SELECT DISTINCT policy, ratio, question_aware, {', '.join(POINT_COLUMNS)} "
                            "FROM cells").fetchall()
        db.close()
        for policy, ratio, question_aware, *point in stored:
            assert tuple(point) == store_module._point_columns(Point(policy, ratio, bool(question_aware))), path.name
