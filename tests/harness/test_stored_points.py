"""Every stored form still reads as a Point (issue 52): each row of every results store in the repository (its
policy column, ratio, question-awareness and the ``cell`` record in its config), a contract as ``kvsieve certify``
wrote them before Point (pinned below), every contract file in the repository, and every grid config in configs/ and
experiments/.
Stores are opened read-only and immutable: no tracked file is rewritten, and no -wal or -shm file is left beside
one."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from kvsieve.config import read_config_file
from kvsieve.harness.grid import GridConfig, cells_for
from kvsieve.policies.label import Mode, Point
from kvsieve.risk.contract import ContractFile
from kvsieve.risk.runtime import CertifiedPolicy

REPO = Path(__file__).resolve().parents[2]


def tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / line for line in out.split()]


STORES = [p for p in tracked("*.sqlite") if p.is_file()
          and sqlite3.connect(f"file:{p}?mode=ro&immutable=1", uri=True).execute(
              "SELECT 1 FROM sqlite_master WHERE name = 'cells'").fetchone()]


def test_the_repository_holds_results_stores():
    assert len(STORES) >= 10, [p.name for p in STORES]


@pytest.mark.parametrize("path", STORES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_row_of_every_store_reads_as_a_point_and_writes_back_the_same(path):
    beside = {p.name for p in path.parent.iterdir()}
    db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    rows = db.execute("SELECT DISTINCT policy, ratio, question_aware, json_extract(config, '$.cell') FROM cells")
    seen = 0
    for policy, ratio, question_aware, cell in rows:
        point = Point.parse(policy, ratio, bool(question_aware))
        assert (point.stored, point.ratio, point.question_aware) == (policy, ratio, bool(question_aware))
        if cell is not None:  # the row's cell record: the spec and mode as the grid wrote them
            record = json.loads(cell)
            mode = Mode(record.get("chunk_size", 0), record.get("evict_every", 1))
            again = Point(record["policy"], record["ratio"], record["question_aware"], mode)
            assert again == point and again.as_dict() == {**again.as_dict(), **record}
        seen += 1
    db.close()
    assert seen > 0 and {p.name for p in path.parent.iterdir()} == beside


# a contract as kvsieve certify wrote it before Point (its buckets as stored; the file adds the contract's header)
OLD_BUCKET = {
    "alpha": 0.1, "delta": 0.1, "epsilon": 0.0, "loss": "binary", "correction": "holm", "n": 60, "reason": "",
    "chosen": {"policy": "snapkv", "question_aware": False, "ratio": 0.5}, "fell_back": False,
    "candidates": [
        {"policy": "snapkv", "ratio": 0.5, "question_aware": False, "empirical_risk": 0.0, "p_value": 0.0018,
         "certified": True, "kept_fraction": 0.52, "setting": "query-agnostic prefill"},
        {"policy": "tova@decode64", "ratio": 0.75, "question_aware": False, "empirical_risk": 0.2, "p_value": 0.9,
         "certified": False, "kept_fraction": 0.3,
         "setting": "decode-time eviction every 64 tokens, question read under eviction"}],
}


def test_a_contract_written_before_point_reads_and_writes_back_unchanged(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({
        "kvsieve_contract": 1, "model": "smollm2-135m-instruct", "by": "none", "length_edges": [],
        "length_quantity": "context_tokens", "source": {}, "points": {},
        "contract": {"alpha": 0.1, "delta": 0.1, "epsilon": 0.0, "loss": "binary", "correction": "holm",
                     "split_fraction": 0.5},
        "buckets": {"all": OLD_BUCKET}}))
    contract = ContractFile.read(path)
    cert = contract.buckets["all"]
    assert cert.chosen == Point("snapkv", 0.5) and cert.candidates[1].candidate == Point.parse("tova@decode64", 0.75)
    assert cert.candidates[1].candidate.mode == Mode(64)
    written = json.loads(contract.write(tmp_path / "again.json").read_text())
    assert written["buckets"]["all"] == OLD_BUCKET


CONTRACTS = [p for p in tracked("*.json") if p.is_file() and '"kvsieve_contract"' in p.read_text()]


def test_the_repository_holds_contracts():
    assert CONTRACTS, "no tracked contract file"


@pytest.mark.parametrize("path", CONTRACTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_contract_in_the_repository_reads_and_picks_its_points(path, tmp_path, monkeypatch):
    """Each tracked contract reads (every candidate and chosen point a Point), writes back the same buckets, and its
    runtime picks, per bucket, the point the file records (full KV where it fell back)."""
    monkeypatch.chdir(REPO)  # program: and checkpoint paths are the repository's
    data = json.loads(path.read_text())
    contract = ContractFile.read(path)
    assert all(isinstance(c.candidate, Point) for cert in contract.buckets.values() for c in cert.candidates)
    written = json.loads(contract.write(tmp_path / "again.json").read_text())
    assert written["buckets"] == data["buckets"] and written["points"] == data["points"]
    if contract.by != "none":
        return  # routing a request to a bucket needs its task or length; reading is what this checks
    chosen = CertifiedPolicy(contract, contract.model).operating_point()
    record = data["buckets"]["all"]["chosen"]
    if record is None:
        assert chosen.fell_back and chosen.point.is_full
    else:
        assert (chosen.point.stored, chosen.point.ratio, chosen.point.question_aware) == (
            record["policy"], record["ratio"], record["question_aware"])


GRID_FIELDS = set(GridConfig.__dataclass_fields__)
GRID_CONFIGS = [p for p in tracked("configs/*.toml") + tracked("experiments/*/*.toml")
                if set(read_config_file(p)) <= GRID_FIELDS]


def test_the_repository_holds_grid_configs():
    assert len(GRID_CONFIGS) >= 5, [p.name for p in GRID_CONFIGS]


@pytest.mark.parametrize("path", GRID_CONFIGS, ids=lambda p: p.name)
def test_every_grid_config_expands_to_points_whose_stored_text_round_trips(path, monkeypatch):
    monkeypatch.chdir(REPO)  # program: and checkpoint paths are the repository's
    config = GridConfig(**read_config_file(path))
    cells = cells_for(config)
    assert cells and all(isinstance(c, Point) for c in cells)
    for cell in cells:
        assert Point.parse(cell.stored, cell.ratio, cell.question_aware) == cell
        assert cell.policy_spec.text == cell.spec  # the grid's parsed spec, kept by the point
