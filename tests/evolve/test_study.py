"""The graded fitness, the random-program control and the matched-budget study (issue 50)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_evolve import tiny_model_and_tokenizer, tiny_run_config

from kvsieve.engine.cache import clone_cache
from kvsieve.evolve.cascade import DevSet, evaluate_program, likelihood_score
from kvsieve.evolve.database import ProgramDatabase, ProgramRecord
from kvsieve.evolve.evolve_config import EvolveConfig, dev_samples
from kvsieve.evolve.mutators.random_programs import RandomProgramMutator
from kvsieve.evolve.pick import pick_among
from kvsieve.evolve.seeds import SEEDS
from kvsieve.evolve.study import evaluated_records, per_request, run_study, study_runs
from kvsieve.evolve.study_report import spread_programs, study_report
from kvsieve.language.program_source import Program
from kvsieve.language.static_check import check_source

ORDER = ("dev_score", "proxy_gap", "heldout_score")


def record(i: int, score: float | None, proxy: float | None = 0.5, code: str = "") -> ProgramRecord:
    return ProgramRecord(id=i, generation=i, island=0, slot=0, parent_id=None, inspiration_ids=[], mutator="m",
                         operation="o", source="", code_hash=code or f"h{i}", status="ok", stage=2, reason="",
                         proxy=proxy, score=score, cells={}, degenerate=False, cell="", seconds=0.0,
                         sandbox_seconds=0.0, kept_hash="")


def test_likelihood_score_is_the_mean_geometric_token_probability():
    logprobs = [-0.1, -2.0, -7.5]
    assert likelihood_score(logprobs) == pytest.approx(100 * np.mean(np.exp(logprobs)), rel=1e-12)
    with pytest.raises(ValueError, match="no dev cells"):
        likelihood_score([])


def test_pick_at_a_budget_follows_the_rule_on_the_first_n():
    """The best dev score among the first N, ties broken by the smaller gap, then the earlier slot (by hand)."""
    records = [record(0, 10.0), record(1, 30.0, 0.9), record(2, 30.0, 0.2), record(3, 50.0), record(4, None)]
    assert pick_among(ORDER, records[:1]).id == 0
    assert pick_among(ORDER, records[:2]).id == 1
    assert pick_among(ORDER, records[:3]).id == 2  # tie on 30: the smaller gap
    assert pick_among(ORDER, records).id == 3
    assert pick_among(ORDER, [record(4, None)]) is None


def test_per_request_averages_the_ratios_and_programs_spread_over_the_fitness():
    assert per_request({"0/0.75": 10.0, "0/0.875": 30.0, "1/0.75": 5.0}) == {0: 20.0, 1: 5.0}
    chosen = spread_programs([record(i, float(i)) for i in range(10)], 4)
    assert [r.score for r in chosen] == [0.0, 3.0, 6.0, 9.0]


def test_random_programs_pass_stage_0_ignore_the_parent_and_are_reproducible():
    mutator = RandomProgramMutator()
    sources = set()
    for i in range(60):
        child = mutator.propose(Program(SEEDS["snapkv"]), [], random.Random(i))
        check_source(child.source)
        child.selection_params  # noqa: B018 - a valid SELECTION
        again = RandomProgramMutator().propose(Program(SEEDS["frc"]), [Program(SEEDS["tova"])], random.Random(i))
        assert again.source == child.source  # the parent and inspirations are not read
        sources.add(child.source)
    assert len(sources) > 50 and mutator.failed == 0


def test_config_checks_the_fitness_and_cells():
    with pytest.raises(ValueError, match="fitness must be one of"):
        EvolveConfig(fitness="kl")
    with pytest.raises(ValueError, match="needs fitness 'likelihood'"):
        EvolveConfig(dev_cells="alternate")
    with pytest.raises(ValueError, match="unknown arm"):
        study_runs(EvolveConfig(), ["greedy"], [0])


@pytest.mark.model
def test_likelihood_fitness_scores_each_cell_by_its_teacher_forced_answer(smollm2, tmp_path):
    """Each cell's value is 100 exp(mean answer log-probability), computed here independently: the question read
    on the compressed cache, then the answer teacher-forced token by token; alternate cells: sample i at ratio
    ratios[i % 2]; the full cache's reference is the same quantity on the uncompressed cache."""
    model, tokenizer = tiny_model_and_tokenizer(smollm2[1])
    config = tiny_run_config(tmp_path, 4, ratios=[0.5, 0.75], dev_samples=3)
    dev = DevSet(model, tokenizer, dev_samples(config, tokenizer, config.dev_seed, 3), config.ratios, config.window)
    program = Program(SEEDS["tova"])
    evaluation = evaluate_program(program, dev, fitness="likelihood", alternate=True)
    assert evaluation.status == "ok" and evaluation.stage == 2
    assert sorted(evaluation.cells) == ["0/0.5", "1/0.75", "2/0.5"]
    policy = Program(SEEDS["tova"])  # the same program as an ordinary policy, outside the sandbox
    from kvsieve.policies.program import ProgramPolicy

    logprobs, gaps = [], []
    for key in sorted(evaluation.cells):
        i, ratio = int(key.split("/")[0]), float(key.split("/")[1])
        item = dev.items[i]
        expected = []
        for cache in (dev.compressed(i, ProgramPolicy(source=policy.source, window=dev.window), ratio),
                      clone_cache(item.cache)):
            with torch.no_grad():
                ids = torch.cat([item.prompt.question_ids, item.answer_ids], dim=1)
                from kvsieve.engine.attach import attach

                with attach(model, dev.capture, ratio=0.0):
                    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0].float()
            q, a = item.prompt.question_ids.shape[1], item.answer_ids.shape[1]
            lp = torch.log_softmax(logits[q - 1:q - 1 + a], dim=-1).gather(-1, item.answer_ids[0][:, None])
            expected.append(float(lp.mean()))
        logprobs.append(expected[0])
        gaps.append(expected[1] - expected[0])
        assert evaluation.cells[key] == pytest.approx(100 * math.exp(expected[0]), rel=1e-4)
    assert evaluation.score == pytest.approx(100 * np.mean(np.exp(logprobs)), rel=1e-4)
    assert evaluation.proxy == pytest.approx(np.mean(gaps), abs=1e-4)
    # the decoded task score on alternate cells: those cells of the every-cell evaluation
    every = evaluate_program(program, dev, fitness="task")
    some = evaluate_program(program, dev, fitness="task", alternate=True)
    assert sorted(every.cells) == ["0/0.5", "0/0.75", "1/0.5", "1/0.75", "2/0.5", "2/0.75"]
    assert some.cells == {key: every.cells[key] for key in evaluation.cells}
    assert some.score == pytest.approx(np.mean(list(some.cells.values())))


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
    from test_evolve import rows

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
    assert "4 evaluated candidates each" in at_four and "| random | random | 4 |" in at_four
    cached = json.loads((tmp_path / "study" / "heldout.json").read_text())
    assert all(set(v) >= {"task", "likelihood", "task_cells"} for v in cached.values())

    def refuse(*_, **__):
        raise AssertionError("held-out scores are cached")

    import kvsieve.evolve.study as study

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
