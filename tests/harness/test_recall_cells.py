"""Recall as a grid cell: ``SPEC@recall(...)`` cells share the sample's read, give what ``generate`` gives alone,
store their hot, cold and moved bytes, and are listed by the grid (tiny random llama, char tokenizer)."""

from __future__ import annotations

import pytest
import torch
from conftest import TOKENIZER, tiny_model

from kvsieve.harness.evaluate import evaluate_sample
from kvsieve.harness.grid import GridConfig, cells_for
from kvsieve.policies.label import Mode, Point
from kvsieve.recall import Recall
from kvsieve.tasks.sample import Sample

RECALL = Recall(0.1, chunk=4)


def _sample() -> Sample:
    text = "The code word is kiwi. " * 6 + "Some more filler text follows here, and then the end."
    return Sample(id="s0", task="toy", context=text, question="What is the code word?", answer_prefix="It is",
                  answers=["kiwi"], max_new_tokens=4, length=200, seed=0, metric="string_match_all")


@torch.no_grad()
def test_recall_cells_shared_and_alone_agree_and_store_their_tiers():
    model = tiny_model("llama", seed=3)
    cells = [Point("full", 0.0), Point("knorm", 0.75), Point("knorm", 0.75, mode=Mode(recall=RECALL)),
             Point("snapkv(window=8)", 0.75, mode=Mode(recall=Recall(0.05, sketch="sign", cold="int8")))]
    shared = evaluate_sample(model, TOKENIZER, _sample(), cells, "tiny")
    alone = evaluate_sample(model, TOKENIZER, _sample(), cells, "tiny", shared=False)
    for a, b in zip(shared, alone, strict=True):
        assert (a.key, a.prediction, a.kept_tokens, a.cache_bytes) == (b.key, b.prediction, b.kept_tokens,
                                                                       b.cache_bytes)
    plain, recalled, sketched = shared[1], shared[2], shared[3]
    assert recalled.key.policy == "knorm@recall(fraction=0.1, chunk=4)"
    for row in (recalled, sketched):
        assert row.config["cold_bytes"] > 0 and row.config["moved_bytes"] > 0
        assert row.config["cell"]["recall"] == Point.parse(row.key.policy, 0.75).mode.recall.text
    # the same point's bytes: the policy keeps less so that what a question recalls fits
    assert recalled.config["hot_bytes"] < plain.cache_bytes
    assert recalled.cache_bytes == recalled.config["hot_bytes"] + recalled.config["moved_bytes"]
    assert recalled.cache_bytes <= plain.cache_bytes * 1.05
    assert sketched.config["cold_bytes"] < recalled.config["cold_bytes"]  # int8 against exact float32


def test_the_grid_lists_recall_cells_below_each_ratios_kept_share():
    config = GridConfig(policies=["full", "knorm"], ratios=[0.5, 0.95], recalls=["recall(fraction=0.1)"])
    labels = [str(c) for c in cells_for(config)]
    assert labels == ["full@0", "knorm@0.5", "knorm@recall(fraction=0.1)@0.5", "knorm@0.95"]
    with pytest.raises(ValueError, match="recall fraction 2 is not in"):
        GridConfig(recalls=["recall(fraction=2)"])
    with pytest.raises(ValueError, match="prefill setting"):
        GridConfig(recalls=["recall(fraction=0.1)"], mode="decode")


def test_a_recall_label_reads_back_and_bad_ones_are_refused():
    point = Point.parse("snapkv(window=8)@recall(fraction=0.025, sketch='sign')", 0.875)
    assert point.spec == "snapkv(window=8)" and point.mode.recall == Recall(0.025, sketch="sign")
    assert Point.parse(point.stored, 0.875) == point and point.display == point.stored
    with pytest.raises(ValueError, match=r"recall fraction 0.2 is outside \[0, 0.125\)"):
        Point.parse("knorm@recall(fraction=0.2)", 0.875)
    with pytest.raises(ValueError, match="evicts nothing"):
        Point.parse("full@recall(fraction=0.1)", 0.0)
    assert Point.parse("knorm@recall(fraction=0.1)").budget is None  # a label reads at ratio 0, and runs as full KV
    with pytest.raises(ValueError, match="unknown: size"):
        Point.parse("knorm@recall(fraction=0.1, size=3)", 0.5)
    with pytest.raises(ValueError, match="question-aware"):
        Point("knorm", 0.5, True, Mode(recall=Recall(0.1)))
