"""The graded fitness and the random-program control (issue 50): the likelihood fitness against a hand computation,
the selection rule on the first N programs, random programs, the config's checks. The matched-budget study that uses
them is a research script (benchmarks/study/), tested in tests/benchmarks/test_study_runs.py."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from test_evolve import tiny_model_and_tokenizer, tiny_run_config

from kvsieve.engine.cache import clone_cache
from kvsieve.evolve.cascade import DevSet, evaluate_program, likelihood_score
from kvsieve.evolve.database import ProgramRecord
from kvsieve.evolve.evolve_config import EvolveConfig, dev_samples
from kvsieve.evolve.mutators.random_programs import RandomProgramMutator
from kvsieve.evolve.pick import pick_among
from kvsieve.evolve.seeds import SEEDS
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

                with attach(model, dev.capture.policy()):
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
