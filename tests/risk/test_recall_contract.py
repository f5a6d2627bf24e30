"""Certified recall: a (policy, ratio, recall) point certifies from its rows like any other, the contract records
its recall, and the runtime hands it back to generate and the server."""

from __future__ import annotations

import numpy as np
import pytest

from kvsieve.harness.store import CellKey, CellResult, ResultsStore
from kvsieve.policies.label import Point
from kvsieve.recall import Recall
from kvsieve.risk import CertifiedPolicy, Contract, certify_buckets, loss_table

RECALL = "snapkv@recall(fraction=0.1, chunk=32, pool='span')"


def _row(sample: int, label: str, ratio: float, score: float, kept: float) -> CellResult:
    return CellResult(CellKey("m", "niah_multikey_3", 4096, str(sample), label, ratio, False), "", score, ["x"], 10,
                      int(1000 * kept), 1000, 0.1, 0.1, {})


def test_the_most_aggressive_certified_point_carries_its_recall(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(80):
        rows += [_row(i, "full", 0.0, 100.0, 1.0),
                 _row(i, "snapkv", 0.5, 100.0, 0.5),
                 _row(i, "snapkv", 0.875, 0.0 if rng.random() < 0.6 else 100.0, 0.125),  # the cliff without recall
                 _row(i, RECALL, 0.875, 100.0, 0.125)]
    with ResultsStore(tmp_path / "r.sqlite") as store:
        store.add_many(rows)
        candidates = [Point("snapkv", 0.5), Point("snapkv", 0.875), Point.parse(RECALL, 0.875)]
        table = loss_table(store, "m", candidates)
    out = certify_buckets(table, Contract(alpha=0.1, delta=0.1), "m")
    chosen = out.buckets["all"].chosen
    assert chosen == Point.parse(RECALL, 0.875) and chosen.mode.recall == Recall(0.1, chunk=32, pool="span")
    path = out.write(tmp_path / "contract.json")
    point = CertifiedPolicy.from_contract(path).operating_point()
    assert point.point.stored == RECALL and point.point.engine_options == {"recall": chosen.mode.recall}
    assert not point.fell_back


def test_a_contract_whose_recall_does_not_fit_its_ratio_is_refused(tmp_path):
    with pytest.raises(ValueError, match="recall fraction 0.2 is outside"):
        Point.parse("snapkv@recall(fraction=0.2)", 0.875)
