"""benchmarks/wrong_answers.py: each answer sorted by how it is wrong, on the requests the full cache answers right."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvsieve.harness.store import CellKey, CellResult, ResultsStore
from kvsieve.tasks.sample import Sample, write_jsonl

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "wrong_answers.py"
ASKED, OTHER = "0a1b2c3d-0000-4111-8222-333344445555", "99999999-aaaa-4bbb-8ccc-dddddddddddd"


def _row(sample_id: str, policy: str, ratio: float, prediction: str, score: float) -> CellResult:
    key = CellKey("m", "niah_multikey_3", 64, sample_id, policy, ratio, False)
    return CellResult(key, prediction, score, [ASKED], 1, 1, 2, 0.0, 0.0, {})


def test_answers_are_sorted_by_kind_on_the_requests_the_full_cache_gets_right(tmp_path):
    context = f"One of the uuids for x is: {ASKED}.\nOne of the uuids for y is: {OTHER}.\n"
    samples = [Sample(id=f"s{i}", task="niah_multikey_3", context=context, question="Which?", answer_prefix="",
                      answers=[ASKED], max_new_tokens=8, length=64, seed=i, metric="string_match_all")
               for i in range(5)]
    write_jsonl(samples, tmp_path / "data.jsonl")
    # the asked uuid with its last four characters changed: 32 of 36 shared, and found nowhere in the context
    clipped = ASKED[:-4] + "ffff"
    rows = [_row(f"s{i}", "full", 0.0, ASKED, 100.0) for i in range(4)] + [_row("s4", "full", 0.0, OTHER, 0.0)]
    rows += [_row("s0", "p", 0.5, f" {ASKED}.", 100.0), _row("s1", "p", 0.5, f" {OTHER}.", 0.0),
             _row("s2", "p", 0.5, f" {clipped}.", 0.0), _row("s3", "p", 0.5, "I do not know.", 0.0),
             _row("s4", "p", 0.5, f" {ASKED}.", 100.0)]  # the full cache's miss: not counted
    with ResultsStore(tmp_path / "s.sqlite") as store:
        store.add_many(rows)
    out = subprocess.run([sys.executable, str(SCRIPT), "--store", str(tmp_path / "s.sqlite"), "--data",
                          str(tmp_path / "data.jsonl"), "--task", "niah_multikey_3"], capture_output=True,
                         text=True, check=True).stdout
    assert "4 requests the full cache answers right (of 5); 2-2 distinct identifiers a context" in out
    line = next(line for line in out.splitlines() if line.startswith("| p |"))
    assert [cell.strip() for cell in line.split("|")[2:-1]] == ["50.0%", "1", "1", "1", "1", "32/36"]
