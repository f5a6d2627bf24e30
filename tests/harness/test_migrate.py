"""Store keys by name (issue 71): rows stored under a path to a named program or checkpoint are renamed to the name's
key by `python -m kvsieve.harness.migrate`, found by the name afterwards, and every figure of the store's headline
report recomputes the same; rows computed from other bytes, and labels whose files are gone, keep their keys."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsieve.config import load_config
from kvsieve.harness.content import check_store
from kvsieve.harness.grid import GridConfig, cells_for
from kvsieve.harness.headline import headline_report
from kvsieve.harness.migrate import migrate, store_points
from kvsieve.harness.store import CellKey, CellResult, ResultsStore
from kvsieve.language.shipped_programs import PROGRAM_DIR, PROGRAMS
from kvsieve.policies import parse
from kvsieve.policies.label import Mode, Point

ROOT = Path(__file__).resolve().parents[2]
NAME = "program:smollm2-pick"


def cell(policy: str, ratio: float, sample: str, score: float, digest: str | None) -> CellResult:
    config = {"cell": {"policy": policy.split("@")[0], "ratio": ratio}}
    if digest is not None:
        config["policy_digest"] = digest
    return CellResult(CellKey("m", "t", 1024, sample, policy, ratio, False), "p", score, ["a"], 1, 25 if ratio else 100,
                      100, 10.0, 0.0, config)


@pytest.fixture
def stored(tmp_path) -> tuple[Path, str, str]:
    """A store written before names: rows of a copy of the SmolLM2 pick keyed by its path (prefill and decode), rows
    of another program, and rows of a path whose file later became a named program's but were computed from other
    bytes."""
    copy = tmp_path / "picked" / "smollm2-135m-instruct-picked.py"
    copy.parent.mkdir()
    shutil.copyfile(PROGRAM_DIR / PROGRAMS["smollm2-pick"].file, copy)
    other = tmp_path / "best.py"
    other.write_text("def score(f):\n    return f.key_norm\n")
    old, kept = f"program:{copy}", f"program:{other}"
    digest = parse(NAME).digest
    rows = []
    for i, (full, pick, base) in enumerate([(100, 100, 50), (100, 50, 50), (50, 50, 0), (0, 0, 0), (100, 100, 100)]):
        sample = f"s{i}"
        rows += [cell("full", 0.0, sample, full, None), cell("full@decode128", 0.0, sample, full, None),
                 cell(old, 0.75, sample, pick, digest), cell(old, 0.875, sample, pick / 2, digest),
                 cell(f"{old}@decode128", 0.75, sample, base, digest),
                 cell(kept, 0.75, sample, base, parse(kept).digest)]
    stale = tmp_path / "stale" / "smollm2-135m-instruct-picked.py"
    stale.parent.mkdir()
    shutil.copyfile(copy, stale)
    rows += [cell(f"program:{stale}", 0.75, "s0", 0, "0" * 64)]  # rows of the file's earlier bytes
    path = tmp_path / "store.sqlite"
    with ResultsStore(path) as store:
        store.add_many(rows)
    return path, old, kept


def test_a_migrated_store_is_read_by_the_name_with_every_figure_unchanged(stored):
    path, old, kept = stored
    pairs = [(old, "full"), (old, kept), (f"{old}@decode128", "full@decode128")]
    before = headline_report([path], compare_pairs=pairs, resamples=500)
    with ResultsStore(path) as store:
        counts = {label: store.count(policy=label) for label in (old, f"{old}@decode128", kept)}

    renames = migrate(path)

    assert {(r.old, r.new, r.rows) for r in renames if r.new} == {
        (old, NAME, counts[old]), (f"{old}@decode128", f"{NAME}@decode128", counts[f"{old}@decode128"])}
    stale = [r for r in renames if not r.new]
    assert len(stale) == 1 and "other bytes" in stale[0].why  # the earlier bytes' rows keep their path
    with ResultsStore(path) as store:
        assert store.count(policy=[old, f"{old}@decode128"]) == 0
        assert store.count(policy=NAME) == counts[old] and store.count(policy=kept) == counts[kept]
        row = store.rows(policy=NAME)[0]
        assert row.config["cell"]["policy"] == NAME and row.config["renamed_from"] == old
        assert row.key.point.spec == NAME  # its stored point renamed with it
        assert store.rows(policy=f"{NAME}@decode128")[0].key.point == Point(NAME, 0.75, mode=Mode(128))
    # the same report, the label aside; asked by the old path, the rows are found by its name
    after = headline_report([path], compare_pairs=pairs, resamples=500)
    assert after == before.replace(old, NAME)
    named = [(NAME, "full"), (NAME, kept), (f"{NAME}@decode128", "full@decode128")]
    assert headline_report([path], compare_pairs=named, resamples=500) == after
    assert migrate(path) == stale  # done once: nothing more to rename


def test_the_command_prints_what_it_renames_and_a_dry_run_changes_nothing(stored):
    path, old, _ = stored
    run = [sys.executable, "-m", "kvsieve.harness.migrate", "--dry-run", str(path)]
    out = subprocess.run(run, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert f"{old} -> {NAME}" in out and "would rename" in out
    with ResultsStore(path) as store:
        assert store.count(policy=NAME) == 0
    out = subprocess.run(run[:3] + run[4:], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert f"{old} -> {NAME}" in out and "renamed" in out
    with ResultsStore(path) as store:
        assert store.count(policy=NAME) == 10


def test_a_rename_onto_rows_already_under_the_name_refuses_a_cell_stored_twice(stored):
    path, old, _ = stored
    with ResultsStore(path) as store:
        store.add(cell(NAME, 0.75, "s0", 0, parse(NAME).digest))  # a later run under the name, on the same cell
    with pytest.raises(ValueError, match="already"):
        migrate(path)
    with ResultsStore(path) as store:  # nothing changed: one transaction
        assert store.count(policy=old) == 10 and store.count(policy=f"{old}@decode128") == 5
        assert store.count(policy=NAME) == 1


def test_the_tracked_stores_are_migrated(monkeypatch):
    """Every results store under results/ keeps each row's point in structured form and keys its rows of named
    programs and checkpoints by name (the labels of files since removed, and rows of older bytes, are left as they
    are)."""
    monkeypatch.chdir(ROOT)  # stored paths are relative to the repository
    stores = sorted((ROOT / "results").glob("*.sqlite"))
    assert stores
    for path in stores:
        pending = [r for r in migrate(path, apply=False) if r.new]
        assert not pending, f"{path.name}: {pending}"
        assert store_points(path, apply=False) == 0, path.name
    with ResultsStore(ROOT / "results/lmeval-ruler-qwen-4k-fresh.sqlite") as store:
        assert store.count(policy="program:qwen-pick-floor-high") == 204
    # the declared configs, by name or (as they were run) by path, find every one of their cells' labels stored
    for config in ["configs/lmeval-ruler-qwen-4k-fresh.toml", "configs/lmeval-ruler-smollm2-2k-learned.toml",
                   "experiments/2026-12-05-graded-rule-rebuilt-qwen/lmeval-ruler-qwen-4k-seeded-pick.toml",
                   "experiments/2026-12-06-graded-rule-refined-surrogate/lmeval-ruler-qwen-4k-refined-pick.toml"]:
        grid = load_config(GridConfig, config)
        with ResultsStore(grid.store) as store:
            stored = {k.policy for k in store.keys()}
            assert {cell.stored for cell in cells_for(grid)} <= stored, config
            check_store(store, grid.model, {c.stored: c.policy_spec.digest for c in cells_for(grid)})
