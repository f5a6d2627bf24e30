"""The results store: uniqueness, filters, missing(), round trips, bad files, and resuming after SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvsieve.harness.store import SCHEMA_VERSION, CellKey, CellResult, ResultsStore, SchemaVersionError
from kvsieve.policies.label import Mode, Point

REPO_ROOT = Path(__file__).resolve().parents[2]


def key(sample: str = "s0", policy: str = "snapkv", ratio: float = 0.5, task: str = "qa", model: str = "m",
        length: int = 1024, question_aware: bool = False) -> CellKey:
    return CellKey(model=model, task=task, length=length, sample_id=sample, policy=policy, ratio=ratio,
                   question_aware=question_aware)


def result(k: CellKey, score: float = 1.0, prediction: str = "yes", config: dict | None = None) -> CellResult:
    return CellResult(key=k, prediction=prediction, score=score, answers=["yes", "Yes."], kept_tokens=512,
                      cache_bytes=1000, cache_bytes_full=2000, prefill_seconds=0.25, decode_seconds=0.5,
                      config=config if config is not None else {"seed": 0})


@pytest.fixture
def store(tmp_path):
    with ResultsStore(tmp_path / "results.db") as s:
        yield s


def test_wal_mode_and_parent_created(tmp_path):
    path = tmp_path / "deep" / "er" / "results.db"
    with ResultsStore(path) as s:
        assert path.exists()
        assert s.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s.schema_version == SCHEMA_VERSION
        assert s.count() == 0


def test_add_is_unique_per_key(store):
    k = key()
    assert store.add(result(k, score=0.25)) is True
    assert store.add(result(k, score=0.75)) is False  # ignored, first write wins
    assert store.count() == 1
    assert store.rows()[0].score == 0.25
    # ratio is compared after rounding to 6 decimals
    assert store.add(result(key(ratio=0.5 + 1e-9))) is False
    assert store.has(key(ratio=0.5000000001))
    # every key field participates in uniqueness
    others = [key(sample="s1"), key(policy="snapkv(window=32)"), key(ratio=0.75), key(task="sum"), key(model="m2"),
              key(length=2048), key(question_aware=True)]
    for other in others:
        assert not store.has(other)
        assert store.add(result(other)) is True
    assert store.count() == 1 + len(others)


def test_uniqueness_across_connections(tmp_path):
    path = tmp_path / "r.db"
    with ResultsStore(path) as a, ResultsStore(path) as b:
        assert a.add(result(key()))
        assert not b.add(result(key()))
        assert b.count() == 1


def test_add_many_one_transaction(store):
    keys = [key(sample=f"s{i}") for i in range(50)]
    assert store.add_many(result(k) for k in keys) == 50
    assert store.add_many([result(keys[0]), result(key(sample="new")), result(key(sample="new"))]) == 1
    assert store.count() == 51
    # a failing batch leaves nothing behind
    with pytest.raises(TypeError):
        store.add_many([result(key(sample="x1")), result(key(sample="x2"), config={"bad": object()})])
    assert store.count() == 51


def test_filters(store):
    store.add_many(result(key(sample=f"s{i}", policy=p, ratio=r, task=t, question_aware=qa), score=i)
                   for i in range(3) for p in ("snapkv", "knorm") for r in (0.25, 0.5) for t in ("qa", "sum")
                   for qa in (False, True))
    assert store.count() == 48
    assert len(store.rows(policy="snapkv")) == 24
    assert store.count(policy="snapkv", task="qa", ratio=0.5) == 6
    assert store.count(policy="snapkv", task="qa", ratio=0.5, question_aware=True) == 3
    rows = store.rows(policy="knorm", ratio=0.25, task="sum", question_aware=False)
    assert [r.key.sample_id for r in rows] == ["s0", "s1", "s2"]
    assert all(r.key.policy == "knorm" and r.key.ratio == 0.25 and r.key.question_aware is False for r in rows)
    assert store.count(model="m", length=1024) == 48
    assert store.count(model="other") == 0
    assert store.count(task=["qa", "sum"], policy=("knorm",)) == 24
    assert store.count(task=[]) == 0
    assert store.keys(sample_id="s2", policy="snapkv", ratio=0.5, task="qa") == [
        key(sample="s2", ratio=0.5), key(sample="s2", ratio=0.5, question_aware=True)]
    with pytest.raises(TypeError, match="unknown filter"):
        store.rows(score=1.0)


def test_missing_preserves_order(store):
    grid = [key(sample=f"s{i}", policy=p, ratio=r) for i in range(200) for p in ("a", "b", "c") for r in (0.1, 0.3)]
    random.Random(0).shuffle(grid)
    assert store.missing(grid) == grid
    done = set(grid[::3])
    store.add_many(result(k) for k in done)
    remaining = store.missing(grid)
    assert remaining == [k for k in grid if k not in done]
    assert store.missing(grid + grid[:5]) == remaining  # duplicates in the input come back once
    assert store.missing([]) == []
    stored = grid[0]
    nearly = key(sample=stored.sample_id, policy=stored.policy, ratio=stored.ratio + 1e-9)
    assert store.missing([nearly]) == []  # ratio compared after rounding


def test_missing_thousands_of_keys_is_fast(store):
    grid = [key(sample=f"s{i}", ratio=r) for i in range(2500) for r in (0.25, 0.5, 0.75, 0.9)]
    store.add_many(result(k) for k in grid[:5000])
    start = time.perf_counter()
    assert store.missing(grid) == grid[5000:]
    assert time.perf_counter() - start < 2.0


def test_round_trip(store):
    config = {"model": {"name": "m", "dtype": "bfloat16"}, "policy": "snapkv(window=32)", "ratios": [0.25, 0.5],
              "seed": 3, "flags": {"qa": True, "none": None}, "unicode": "naïve ✓"}
    k = key(policy="snapkv(window=32)", ratio=1 / 3, question_aware=True)
    original = CellResult(key=k, prediction="The answer is 42.\nDone", score=0.5, answers=["42", "forty-two"],
                          kept_tokens=341, cache_bytes=123456, cache_bytes_full=370368, prefill_seconds=1.5,
                          decode_seconds=0.125, config=config)
    store.add(original)
    (back,) = store.rows()
    assert back.config == config
    assert back.answers == ["42", "forty-two"]
    assert back.key.ratio == round(1 / 3, 6)
    assert back.key.question_aware is True and isinstance(back.key.question_aware, bool)
    assert (back.prediction, back.score, back.kept_tokens, back.cache_bytes, back.cache_bytes_full) == (
        original.prediction, 0.5, 341, 123456, 370368)
    assert (back.prefill_seconds, back.decode_seconds) == (1.5, 0.125)
    assert back.key == CellKey("m", "qa", 1024, "s0", "snapkv(window=32)", round(1 / 3, 6), True)



def test_a_key_of_a_point_holds_its_stored_label_ratio_and_question_awareness():
    """CellKey.of is the key the grid, the lm-eval backend and evaluate build: the point's stored label (its decode
    suffix included, never +qa), its ratio and its question-awareness beside the sample's coordinates."""
    assert CellKey.of("m", "qa", 1024, "s0", Point("snapkv(window=32)", 0.5, True)) == CellKey(
        "m", "qa", 1024, "s0", "snapkv(window=32)", 0.5, True)
    assert CellKey.of("m", "qa", 1024, "s0", Point("tova", 0.75, mode=Mode(64, 4))) == CellKey(
        "m", "qa", 1024, "s0", "tova@decode64e4", 0.75, False)
    assert CellKey.of("m", "qa", 1024, "s0", Point.parse("snapkv+qa", 0.5, True)).policy == "snapkv"

def test_unserialisable_config_is_rejected(store):
    with pytest.raises(TypeError, match="JSON"):
        store.add(result(key(), config={"f": {1, 2}}))
    assert store.count() == 0


def test_reopen_keeps_rows(tmp_path):
    path = tmp_path / "r.db"
    with ResultsStore(path) as s:
        s.add(result(key()))
    with ResultsStore(path) as s:
        assert s.count() == 1 and s.has(key())
    s.close()  # closing twice is fine
    with pytest.raises(ValueError, match="closed"):
        s.count()


@pytest.mark.parametrize("content", [b"this is not a database\n" * 200, b"SQLite format 3\x00" + b"\xff" * 4000])
def test_bad_file_error_names_path(tmp_path, content):
    path = tmp_path / "bogus.db"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="bogus.db"):
        ResultsStore(path)


def test_foreign_sqlite_database_is_rejected(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(ValueError, match="not a kvsieve results store"):
        ResultsStore(path)


def test_newer_schema_version_is_rejected(tmp_path):
    path = tmp_path / "future.db"
    with ResultsStore(path) as s:
        s.add(result(key()))
        s.conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(SchemaVersionError, match=rf"schema version {SCHEMA_VERSION + 1}.*future.db|future.db.*"
                                                 rf"schema version {SCHEMA_VERSION + 1}"):
        ResultsStore(path)
    assert issubclass(SchemaVersionError, ValueError)


# -- resumability -------------------------------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys, time
    from kvsieve.harness.store import CellKey, CellResult, ResultsStore

    path, delay = sys.argv[1], float(sys.argv[2])
    grid = [CellKey("m", task, 512, f"s{i}", policy, ratio, False)
            for task in ("qa", "sum") for i in range(5) for policy in ("snapkv", "knorm(p=2)") for ratio in (0.5, 0.8)]
    with ResultsStore(path) as store:
        todo = store.missing(grid)
        print(len(todo), flush=True)
        for k in todo:
            time.sleep(delay)  # "evaluate" the cell
            store.add(CellResult(k, f"pred-{k.sample_id}", 1.0, ["a"], 10, 100, 200, delay, 0.0, {"delay": delay}))
    print("done", flush=True)
""")
GRID_SIZE = 2 * 5 * 2 * 2


def _run_writer(path: Path, delay: float) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(delay)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_resume_after_sigkill(tmp_path):
    path = tmp_path / "runs" / "results.db"
    ResultsStore(path).close()  # the store exists before the writer starts, so the test can watch it

    proc = _run_writer(path, delay=0.1)
    with ResultsStore(path) as watcher:
        deadline = time.monotonic() + 60
        while watcher.count() < 5:
            assert proc.poll() is None, f"writer exited early: {proc.communicate()}"
            assert time.monotonic() < deadline, "writer made no progress"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    with ResultsStore(path) as store:  # reopening after the kill works
        written = store.count()
        assert 5 <= written < GRID_SIZE, "the writer must be killed midway"
        assert all(r.prediction == f"pred-{r.key.sample_id}" and r.config == {"delay": 0.1} for r in store.rows())

    proc = _run_writer(path, delay=0.0)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.split() == [str(GRID_SIZE - written), "done"]  # the rerun computed only the missing cells

    with ResultsStore(path) as store:
        assert store.count() == GRID_SIZE
        keys = store.keys()
        assert len(set(keys)) == GRID_SIZE
        dupes = store.conn.execute("SELECT COUNT(*) FROM cells GROUP BY model, task, length, sample_id, policy, "
                                   "ratio, question_aware HAVING COUNT(*) > 1").fetchall()
        assert dupes == []
        grid = [CellKey("m", task, 512, f"s{i}", policy, ratio, False) for task in ("qa", "sum") for i in range(5)
                for policy in ("snapkv", "knorm(p=2)") for ratio in (0.5, 0.8)]
        assert set(keys) == set(grid)
        assert store.missing(grid) == []
