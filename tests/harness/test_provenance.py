"""Rows that say where they came from: every written row records its machine, threads, dtype, versions and
revision; stores written before that read back as unknown and are migrated on their first write only; tables
refuse to pair rows of two machines unless asked, and say which machines their rows came from."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvsieve.cli import main
from kvsieve.harness import provenance
from kvsieve.harness.headline_format import format_headline
from kvsieve.harness.headline_tables import compare, headline
from kvsieve.harness.provenance import MIXED_FLAG, UNKNOWN, check_one_machine, current, describe
from kvsieve.harness.report import report_text
from kvsieve.harness.store import CellKey, CellResult, ResultsStore

REPO = Path(__file__).resolve().parents[2]

# the schema of the stores written before rows recorded provenance (results/*.sqlite hold such rows)
OLD_SCHEMA = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO schema_version VALUES (1);
CREATE TABLE cells (id INTEGER PRIMARY KEY, model TEXT NOT NULL, task TEXT NOT NULL, length INTEGER NOT NULL,
    sample_id TEXT NOT NULL, policy TEXT NOT NULL, ratio REAL NOT NULL, question_aware INTEGER NOT NULL,
    prediction TEXT NOT NULL, score REAL NOT NULL, answers TEXT NOT NULL, kept_tokens INTEGER NOT NULL,
    cache_bytes INTEGER NOT NULL, cache_bytes_full INTEGER NOT NULL, prefill_seconds REAL NOT NULL,
    decode_seconds REAL NOT NULL, config TEXT NOT NULL, created_at REAL NOT NULL,
    UNIQUE (model, task, length, sample_id, policy, ratio, question_aware));
INSERT INTO cells VALUES (1, 'm', 't', 1024, 's0', 'full', 0.0, 0, 'p', 100.0, '["a"]', 1, 100, 100, 1.0, 0.0,
    '{"dtype": "float32"}', 0.0);
"""


def cell(policy: str, ratio: float, sample: str, score: float, machine: str | None = "cpu A") -> CellResult:
    prov = None if machine is None else {"machine": machine, "threads": 1, "dtype": "float32", "kvsieve": "0.1.0",
                                         "commit": "abc1234567890", "dirty": False}
    return CellResult(CellKey("m", "t", 1024, sample, policy, ratio, False), "p", score, ["a"], 1, 50, 100, 1.0,
                      0.0, {}, provenance=prov)


def test_a_written_row_records_machine_threads_dtype_versions_and_revision(tmp_path):
    torch = pytest.importorskip("torch")
    provenance.revision.cache_clear()  # cached per process: a commit made while the suite runs must not fail this
    with ResultsStore(tmp_path / "s.sqlite") as store:
        store.add(CellResult(CellKey("m", "t", 1024, "s0", "full", 0.0, False), "p", 1.0, ["a"], 1, 1, 1, 0.0, 0.0,
                             {"dtype": "bfloat16"}))
        (row,) = store.rows()
    p = row.provenance
    assert p["dtype"] == "bfloat16"  # the row's own dtype, not the process default
    assert p["threads"] == torch.get_num_threads()
    assert p["kvsieve"] == "0.1.0" and p["torch"] == torch.__version__
    assert p["machine"] and p["machine"] != UNKNOWN and p["cores"] >= 1
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a checkout: the commit kvsieve runs from, and whether it was edited
        assert p["commit"] == head.stdout.strip() and isinstance(p["dirty"], bool)


def test_a_row_brings_its_own_provenance_when_computed_elsewhere(tmp_path):
    with ResultsStore(tmp_path / "s.sqlite") as store:
        store.add_many([cell("full", 0.0, "s0", 1.0, machine="GPU H200")])
        assert store.rows()[0].provenance["machine"] == "GPU H200"


def test_revision_without_git_is_none_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "_REPO", tmp_path)  # not a checkout
    provenance.revision.cache_clear()
    try:
        assert provenance.revision() == {"commit": None, "dirty": None}
        monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
        provenance.revision.cache_clear()
        assert current("float32")["commit"] is None
    finally:
        provenance.revision.cache_clear()


def test_an_old_store_reads_as_unknown_and_is_migrated_only_when_written(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(OLD_SCHEMA)

    def columns() -> set[str]:
        with sqlite3.connect(path) as conn:
            return {r[1] for r in conn.execute("PRAGMA table_info(cells)")}

    with ResultsStore(path) as store:
        (old,) = store.rows()
        assert old.provenance is None and old.score == 100.0
    assert "provenance" not in columns()  # reading (a report) never changes the file
    with ResultsStore(path) as store:
        store.add(cell("snapkv", 0.5, "s0", 50.0))
        old, new = store.rows()
    assert "provenance" in columns()
    assert old.provenance is None and new.provenance["machine"] == "cpu A"


def test_the_committed_stores_still_read(tmp_path):
    stores = sorted((REPO / "results").glob("*.sqlite"))
    if not stores:
        pytest.skip("no committed stores")
    with ResultsStore(stores[0]) as store:
        rows = store.rows()
    assert rows and all(r.provenance is None or "machine" in r.provenance for r in rows)


def test_check_one_machine_counts_unknown_rows_as_another_machine():
    assert check_one_machine([None, None], "x") == {UNKNOWN: 2}
    with pytest.raises(ValueError, match=MIXED_FLAG):
        check_one_machine([None, {"machine": "cpu A"}], "x")
    assert len(check_one_machine([{"machine": "cpu B"}, {"machine": "cpu A"}], "x", allow_mixed=True)) == 2


def test_describe_names_machines_dtypes_threads_and_revisions():
    line = describe([cell("full", 0, "s", 1).provenance, cell("full", 0, "s", 1, machine="cpu B").provenance])
    assert "cpu A (1 rows)" in line and "cpu B (1 rows)" in line
    assert "dtype float32" in line and "threads 1" in line and "revision abc1234567" in line
    assert describe([None]) == f"machine {UNKNOWN}"


def mixed_rows() -> list[CellResult]:
    return [cell("full", 0.0, "s0", 100.0), cell("full", 0.0, "s1", 0.0),
            cell("snapkv", 0.5, "s0", 100.0, machine="cpu B"), cell("snapkv", 0.5, "s1", 0.0, machine="cpu B")]


def test_headline_refuses_rows_of_two_machines_unless_asked():
    with pytest.raises(ValueError, match="2 machines.*cpu A.*--mixed-machines"):
        headline(mixed_rows(), resamples=100)
    (table,) = headline(mixed_rows(), resamples=100, allow_mixed_machines=True)
    assert table.machines == 2
    text = format_headline(table)
    assert "rows of 2 machines paired, as asked" in text and "cpu B (2 rows)" in text
    (one,) = headline([r for r in mixed_rows() if r.key.policy == "full"], resamples=100)
    assert one.machines == 1 and "Rows from: machine cpu A; dtype float32" in format_headline(one)


def test_compare_and_report_refuse_rows_of_two_machines_unless_asked():
    rows = mixed_rows() + [cell("tova", 0.5, "s0", 0.0), cell("tova", 0.5, "s1", 0.0)]
    with pytest.raises(ValueError, match="snapkv - tova"):
        compare(rows, "snapkv", "tova", 0.5, resamples=100)
    assert compare(rows, "snapkv", "tova", 0.5, resamples=100, allow_mixed_machines=True).diff == 50.0
    assert compare(rows, "full", "tova", 0.5, resamples=100).diff == 50.0  # one machine: no refusal
    with pytest.raises(ValueError, match="2 machines"):
        report_text(rows)
    assert "cpu B (2 rows)" in report_text(rows, allow_mixed_machines=True)


def test_cli_report_refuses_a_mixed_store_and_pairs_it_with_the_flag(tmp_path, capsys):
    path = tmp_path / "mixed.sqlite"
    with ResultsStore(path) as store:
        store.add_many(mixed_rows())
    assert main(["report", "--store", str(path), "--headline", "--resamples", "100"]) == 2
    assert "--mixed-machines" in capsys.readouterr().err
    assert main(["report", "--store", str(path), "--headline", "--resamples", "100", "--mixed-machines"]) == 0
    assert "rows of 2 machines paired" in capsys.readouterr().out
    assert main(["report", "--store", str(path)]) == 2


def test_provenance_json_is_what_the_column_holds(tmp_path):
    path = tmp_path / "s.sqlite"
    with ResultsStore(path) as store:
        store.add(cell("full", 0.0, "s0", 1.0))
    with sqlite3.connect(path) as conn:
        (text,) = conn.execute("SELECT provenance FROM cells").fetchone()
    assert json.loads(text)["machine"] == "cpu A"


def test_provenance_module_needs_no_torch():
    # kvsieve report reads provenance without loading torch (its --help and reports stay light)
    code = "import sys; import kvsieve.harness.provenance as p; p.current(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_dirty_means_an_edit_of_the_code_not_a_committed_store_a_run_fills(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "kvsieve").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "kvsieve" / "code.py").write_text("x = 1\n")
    (tmp_path / "results" / "store.sqlite").write_bytes(b"rows")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    monkeypatch.setattr(provenance, "_REPO", tmp_path)
    try:
        states = []
        for path, text in (("results/store.sqlite", "more rows"), ("notes.txt", "untracked"),
                           ("kvsieve/code.py", "x = 2\n")):
            (tmp_path / path).write_text(text)
            provenance.revision.cache_clear()
            states.append(provenance.revision()["dirty"])
        assert states == [False, False, True]
    finally:
        provenance.revision.cache_clear()
