"""The matched-budget study (issue 50; benchmarks/study/, on the path by pyproject's pytest ``pythonpath``): runs grow
in equal rounds and resume, a study's budget counts distinct evaluated programs, and the report picks by the rule."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from study.report import proposals, spread_programs, study_report
from study.runs import distinct, evaluated_records, per_request, picks_at, run_study, study_runs

from kvsieve.evolve.cascade import DevSet
from kvsieve.evolve.database import ProgramDatabase, ProgramRecord
from kvsieve.evolve.evolve_config import EvolveConfig, dev_samples

sys.path.append(str(Path(__file__).parents[1] / "evolve"))  # test_evolve's tiny model and run (as test_ray does)
from test_evolve import rows, tiny_model_and_tokenizer, tiny_run_config  # noqa: E402

ORDER = ("dev_score", "proxy_gap", "heldout_score")


def record(i: int, score: float | None, proxy: float | None = 0.5, code: str = "") -> ProgramRecord:
    return ProgramRecord(id=i, generation=i, island=0, slot=0, parent_id=None, inspiration_ids=[], mutator="m",
                         operation="o", source="", code_hash=code or f"h{i}", status="ok", stage=2, reason="",
                         proxy=proxy, score=score, cells={}, degenerate=False, cell="", seconds=0.0,
                         sandbox_seconds=0.0, kept_hash="")


def test_per_request_averages_the_ratios_and_programs_spread_over_the_fitness():
    assert per_request({"0/0.75": 10.0, "0/0.875": 30.0, "1/0.75": 5.0}) == {0: 20.0, 1: 5.0}
    chosen = spread_programs([record(i, float(i)) for i in range(10)], 4)
    assert [r.score for r in chosen] == [0.0, 3.0, 6.0, 9.0]


def test_the_study_refuses_unknown_arms_and_pairs_the_mixed_mutator_with_selection_and_without():
    with pytest.raises(ValueError, match="unknown arm"):
        study_runs(EvolveConfig(), ["greedy"], [0])
    runs = {r.arm: r.config for r in study_runs(EvolveConfig(out="x"), ["evolve_mixed", "best_of_n_mixed"], [3])}
    assert (runs["evolve_mixed"].strategy, runs["evolve_mixed"].mutator) == ("evolve", "mixed")
    assert (runs["best_of_n_mixed"].strategy, runs["best_of_n_mixed"].mutator) == ("best_of_n", "mixed")
    assert runs["evolve_mixed"].seed == 3 and runs["evolve_mixed"].db.endswith("evolve_mixed-s3.sqlite")


def test_a_studys_budget_counts_each_evaluated_program_once(tmp_path):
    """Two siblings of one generation proposing the same child are both evaluated by the search (a duplicate is
    recognised only against earlier generations), so a run holds two evaluated rows of one program: the study counts
    it once, and the pick at N candidates is among the first N distinct programs (issue 72: in the committed SmolLM2
    study this moves evolve-s1's pick at 16). By hand: seed A, then B, B again, C (best), D; at 3 candidates the
    programs are A, B, C and the rule picks C; counting rows it would pick B from A, B, B."""
    path = tmp_path / "evolve-s0.sqlite"
    db = ProgramDatabase(path)
    db.check_config(dict(EvolveConfig(candidates=99).identity()))
    for generation, slot, code, status, score in [(0, 0, "A", "ok", 10.0), (1, 0, "B", "ok", 20.0),
                                                  (1, 1, "B", "ok", 20.0), (1, 2, "A", "duplicate", 10.0),
                                                  (2, 0, "C", "ok", 30.0), (2, 1, "D", "ok", 5.0)]:
        db.add(dict(generation=generation, island=0, slot=slot, mutator="seed" if generation == 0 else "m",
                    status=status, stage=2, score=score, proxy=0.5, cells={"0/0.75": score}, code_hash=code,
                    source=f"def score(f):\n    return f.key_norm * {score}\n"))
    db.close()
    records = evaluated_records(path)[1]
    assert [r.code_hash for r in records] == ["A", "B", "C", "D"]
    assert [r.code_hash for r in evaluated_records(path, every_row=True)[1]] == ["A", "B", "B", "A", "C", "D"]
    assert distinct(evaluated_records(path, every_row=True)[1]) == records
    picks = picks_at(records, ORDER, [2, 3, 4])
    assert (picks[2].code_hash, picks[3].code_hash, picks[4].code_hash) == ("B", "C", "C")
    # the mutators' proposals up to the 3rd distinct program: both B rows, the duplicate, C (not the seed, not D)
    assert [(r.generation, r.slot) for r in proposals(path, 3)] == [(1, 0), (1, 1), (1, 2), (2, 0)]


@pytest.mark.model
def test_study_runs_grow_in_equal_rounds_resume_and_report(smollm2, tmp_path):
    """Every run of a study holds the same number of evaluated candidates after each round; a rerun with a larger
    budget extends them without changing the rows stored; the report picks by the rule and reads held-out scores
    from its cache the second time."""
    model, tokenizer = tiny_model_and_tokenizer(smollm2[1])
    base = replace(tiny_run_config(tmp_path, 4), fitness="likelihood", dev_cells="alternate", heldout_samples=1,
                   out=str(tmp_path / "study"))
    runs = study_runs(base, ["evolve", "best_of_n", "random", "evolve_random"], [0, 1])
    run_study(runs, 3, 3, model, tokenizer, "float32", log=lambda _: None)
    first = {run.config.db: evaluated_records(run.config.db)[1] for run in runs}
    assert {len(r) for r in first.values()} == {3}
    run_study(runs, 5, 2, model, tokenizer, "float32", log=lambda _: None)
    for run in runs:
        config, records = evaluated_records(run.config.db)
        assert len(records) == 5 and config["seed"] == run.seed
        assert [r.source for r in records[:3]] == [r.source for r in first[run.config.db]]
        assert [r.operation for r in records[:2]] == ["snapkv", "tova"]  # the same seed programs open every run
        if run.arm in ("random", "evolve_random"):  # evolve_random opens with the random arm's programs
            assert all(r.operation.startswith("random") for r in records[2:])
        if run.arm == "evolve_random":
            same_seed = next(r for r in runs if r.arm == "random" and r.seed == run.seed)
            assert [r.source for r in records] == [r.source for r in evaluated_records(same_seed.config.db)[1]]
        db = ProgramDatabase(run.config.db)
        assert db.meta("config")["strategy"] == ("evolve" if run.arm.startswith("evolve") else "best_of_n")
        db.close()
    # a run alone, with its own executor and nothing shared, stores the same rows (but the timings)
    from kvsieve.evolve.candidate_executor import LocalExecutor
    from kvsieve.evolve.mutators import make_mutator
    from kvsieve.evolve.search import evolve

    alone = replace(runs[-3].config, candidates=5, db=str(tmp_path / "alone.sqlite"))
    dev = DevSet(model, tokenizer, dev_samples(alone, tokenizer, alone.dev_seed, alone.dev_samples), alone.ratios,
                 alone.window, alone.dev_cache_folder)
    db = ProgramDatabase(alone.db)
    evolve(alone, LocalExecutor(dev, fitness="likelihood", alternate=True), make_mutator(alone), db, progress=False)
    db.close()
    assert rows(alone.db) == rows(runs[-3].config.db)
    report = study_report(base, runs, ORDER, 2, 0, lambda name, dtype: (model, tokenizer),
                          plot=tmp_path / "named.png")
    assert "| evolve - best_of_n |" in report and "| evolve_random - random |" in report
    assert (tmp_path / "named.png").is_file() and not (tmp_path / "study" / "curve.png").exists()
    # the mutators' table: every random proposal passes stage 0 (three per run of five candidates, two seeds); the
    # interval is Wilson's, from its formula
    z, n = 1.959964, 6
    low = (1 + z * z / (2 * n) - z * math.sqrt(z * z / (4 * n * n))) / (1 + z * z / n)
    assert f"| random | random | {n} | 100% [{100 * low:.0f}, 100] |" in report
    assert f"| evolve_random | random | {n} | 100% [{100 * low:.0f}, 100] |" in report
    assert "| random | seed |" not in report  # the seed programs are no mutator's proposals
    with pytest.raises(ValueError, match="budget must be in 1..5"):
        study_report(base, runs, ORDER, 2, 0, lambda name, dtype: (model, tokenizer), budget=6)
    at_four = study_report(base, runs, ORDER, 2, 0, lambda name, dtype: (model, tokenizer),
                           plot=tmp_path / "four.png", budget=4)
    assert "4 distinct evaluated candidates each" in at_four and "| random | random | 4 |" in at_four
    cached = json.loads((tmp_path / "study" / "heldout.json").read_text())
    assert all(set(v) >= {"task", "likelihood", "task_cells"} for v in cached.values())

    def refuse(*_, **__):
        raise AssertionError("held-out scores are cached")

    import study.runs as study

    original = study.evaluate_program
    study.evaluate_program = refuse
    try:
        assert study_report(base, runs, ORDER, 2, 0, lambda name, dtype: (model, tokenizer),
                            plot=tmp_path / "named.png") == report
        # the paired curve, on held-out likelihoods set by hand (the tiny model's are all ~0): each difference's mean
        # is the difference of the two arms' levels; evolve_random and random share their first five candidates
        for code_hash, entry in cached.items():
            entry["likelihood_cells"] = {k: float(int(code_hash[:4], 16) % 97 + i)
                                         for i, k in enumerate(sorted(entry["likelihood_cells"]))}
        (tmp_path / "study" / "heldout.json").write_text(json.dumps(cached))
        synthetic = study_report(base, runs, ORDER, 2, 0, lambda name, dtype: (model, tokenizer),
                                 plot=tmp_path / "named.png")
    finally:
        study.evaluate_program = original
    levels, paired = (table.split("\n\n")[0].splitlines() for table in synthetic.split("| N | ")[1:3])
    columns = [c.strip(" |") for c in paired[0].split(" | ")]
    arm_level = [float(c.split(" [")[0]) for c in levels[-1].split(" | ")[1::2]]  # held-out columns, arms in order
    level = dict(zip(["evolve", "best_of_n", "random", "evolve_random"], arm_level, strict=True))
    assert len(set(arm_level)) > 1  # the check below can fail
    differences = [float(c.split(" [")[0]) for c in paired[-1].split(" | ")[1:]]
    for name, difference in zip(columns, differences, strict=True):
        a, b = name.split(" - ")
        assert abs(difference - (level[a] - level[b])) <= 0.11, name
    assert level["evolve_random"] == level["random"] and "evolve - best_of_n" in columns
