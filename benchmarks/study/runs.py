"""The matched-budget study (issue 50): does evolution find better programs than its controls at equal cost?

Five arms start from the same seed program(s) and evaluate the same number of candidates per run, each run under
its own seed (``EvolveConfig.seed``: every random choice of the run):

- ``evolve``: the islands and MAP-Elites parents of ``search.py``, structural mutator;
- ``best_of_n``: every child a structural mutation of the first seed program, no score read (selection only at
  the end);
- ``random``: every child a fresh random program (``mutators/random_programs.py``), no parent, no score read;
- ``evolve_mixed`` and ``best_of_n_mixed``: the first two with the mixed mutator (``mutators/mixed.py``: a structural
  edit, or random terms of the ``random`` arm's generator grafted into the parent), so selection can refine the
  random finds the ``random`` arm only samples.

All runs of a study share one model, one dev set and their evaluations (:class:`SharedExecutor`) in one process
(:func:`run_study`); they grow in rounds of
``step`` candidates, every run of a round before the next round, so a study stopped at any time holds runs of
equal budgets (up to one round), and a rerun resumes every run from its database (``search.evolve``).

Each run's program is picked by the fixed rule (``configs/selection.toml``'s ``order``, :func:`pick.pick_among`)
among its first N distinct evaluated programs (seeds included; duplicates and unusable proposals cost nothing, and so
does a second row of a program the run had already evaluated: two siblings of one generation proposing the same
child are both evaluated by the search, but the study counts that program once, by its code digest), for every N of
the curve; the picks are then scored on held-out requests (:class:`HeldoutScores`, cached by code hash).
Comparisons pool the seeds: :func:`~kvsieve.bootstrap.two_level_interval` resamples seeds and requests.
"""

from __future__ import annotations

import functools
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from kvsieve.evolve.candidate_executor import LocalExecutor
from kvsieve.evolve.cascade import DevSet, Evaluation, KnownKept, evaluate_program
from kvsieve.evolve.database import ProgramDatabase, ProgramRecord
from kvsieve.evolve.evolve_config import EvolveConfig, dev_samples
from kvsieve.evolve.mutators import LLM_MUTATORS, Mutator, make_mutator
from kvsieve.evolve.pick import pick_among
from kvsieve.evolve.sandbox import SandboxLimits, require_isolation
from kvsieve.evolve.search import evolve
from kvsieve.files import written_whole
from kvsieve.language.program_source import Program
from kvsieve.models import load

__all__ = ["ARMS", "SKIPPED", "SharedExecutor", "StudyRun", "study_runs", "run_study", "evaluated_records", "distinct",
           "picks_at", "per_request", "HeldoutScores"]

ARMS = {"evolve": dict(strategy="evolve", mutator="structural"),
        "best_of_n": dict(strategy="best_of_n", mutator="structural"),
        "random": dict(strategy="best_of_n", mutator="random"),
        "evolve_mixed": dict(strategy="evolve", mutator="mixed"),
        "best_of_n_mixed": dict(strategy="best_of_n", mutator="mixed"),
        # an initial population of random programs (4 generations: 8 programs at 2 a generation, a third of a
        # 24-candidate run; the random arm with the same seed draws the same 8), then structural evolution
        "evolve_random": dict(strategy="evolve", mutator="structural", random_generations=4),
        # the bundled coder decoding under the language's grammar (mutators/constrained.py), prompted with the
        # parent, inspirations and their dev scores; best-of-N asks it for children of the seed program only
        "evolve_llm": dict(strategy="evolve", mutator="constrained"),
        "best_of_n_llm": dict(strategy="best_of_n", mutator="constrained")}
SKIPPED = ("duplicate", "no_proposal", "migrated")  # rows that cost no evaluation
KEPT_REASON = "keeps the entries of program #"  # cascade's reason for a result taken from a run's earlier program


@dataclass(frozen=True)
class StudyRun:
    arm: str
    seed: int
    config: EvolveConfig


def study_runs(base: EvolveConfig, arms: Iterable[str], seeds: Iterable[int]) -> list[StudyRun]:
    """One run per (seed, arm): ``base`` with the arm's strategy and mutator, the seed, and its own database and
    folder under ``base.out`` (``ARM-sSEED.sqlite``); the dev cache stays ``base``'s (shared)."""
    runs = []
    for seed in seeds:
        for arm in arms:
            if arm not in ARMS:
                raise ValueError(f"unknown arm {arm!r}; allowed: {', '.join(ARMS)}")
            name = f"{arm}-s{seed}"
            config = replace(base, **ARMS[arm], seed=seed, db=str(Path(base.out) / f"{name}.sqlite"),
                             out=str(Path(base.out) / name), dev_cache=str(base.dev_cache_folder))
            runs.append(StudyRun(arm, seed, config))
    return runs


class SharedExecutor:
    """A :class:`LocalExecutor` whose fresh evaluations are shared by every run of the study, by program text: the
    runs score on one dev set, and an evaluation is deterministic (the same program, dev set and process give the same
    row), so the seed program and the children two runs both propose (common in the seed's small one-edit
    neighbourhood) are computed once. A result a run takes from its own earlier programs (``known``: "keeps the
    entries of program #N", naming that run's row) is never shared; a shared result is given that form when the
    run's ``known`` holds its kept entries, exactly as a fresh evaluation in that run would be."""

    def __init__(self, inner: LocalExecutor) -> None:
        self.inner = inner
        self.shared: dict[str, Evaluation] = {}
        self.hits = 0

    def evaluate(self, programs: list[Program], max_gap: float | None = None,
                 on_result: Callable[[int, Evaluation], None] | None = None,
                 known: Mapping[str, KnownKept] | None = None) -> list[Evaluation]:
        out = []
        for i, program in enumerate(programs):
            found = self.shared.get(program.source)
            if found is None:
                evaluation = self.inner.evaluate([program], max_gap, None, known)[0]
                if not evaluation.reason.startswith(KEPT_REASON):
                    self.shared[program.source] = evaluation
            else:
                self.hits += 1
                same = (known or {}).get(found.kept_hash) if found.kept_hash else None
                if same is not None and same.score is not None and found.status == "ok":
                    evaluation = replace(found, reason=f"{KEPT_REASON}{same.program_id} in every dev cell",
                                         proxy=same.proxy, score=same.score, cells=dict(same.cells))
                else:
                    evaluation = replace(found, cells=dict(found.cells))
            if on_result is not None:
                on_result(i, evaluation)
            out.append(evaluation)
        return out

    def close(self) -> None:
        self.inner.close()


def run_study(runs: list[StudyRun], candidates: int, step: int, model, tokenizer, dtype: str,
              log: Callable[[str], None] = functools.partial(print, flush=True)) -> None:
    """Grow every run to ``candidates`` evaluated programs in rounds of ``step`` (each round: every run in turn).
    Rerun to resume: each run continues from its database. Log lines are flushed: a study runs for hours under nohup."""
    if step < 1 or candidates < 1:
        raise ValueError(f"candidates and step must be >= 1, got {candidates}, {step}")
    base = runs[0].config
    isolation = require_isolation(base.sandbox)
    dev = DevSet(model, tokenizer, dev_samples(base, tokenizer, base.dev_seed, base.dev_samples), base.ratios,
                 base.window, base.dev_cache_folder, progress=True, surrogate=base.surrogate)
    limits = SandboxLimits(timeout_s=base.sandbox_timeout_s, memory_mb=base.sandbox_memory_mb)
    executor = SharedExecutor(LocalExecutor(dev, limits, base.fitness, base.dev_cells == "alternate"))
    budgets = sorted({*range(step, candidates + 1, step), candidates})
    mutators, coders = {}, {}  # one mutator per run, built once; one loaded copy of each LLM coder
    for budget in budgets:
        for run in runs:
            config = replace(run.config, candidates=budget)
            db = ProgramDatabase(config.db)
            if (run.arm, run.seed) not in mutators:
                mutators[run.arm, run.seed] = _mutator(config, coders)
            mutator = mutators[run.arm, run.seed]
            if hasattr(mutator, "score_of"):  # LLM prompts show the parent's and inspirations' dev scores
                mutator.score_of = db.score_of
            try:
                db.check_config(config.identity())
                db.set_meta("isolation", isolation)
                db.check_numerics(dtype, torch.get_num_threads())
                before = _distinct_count(db)
                if before >= budget:
                    continue
                start = time.perf_counter()
                count = before
                while count < budget:  # the search's budget counts a repeated program's rows: give it that many more
                    rows = db.evaluated_count()
                    evolve(replace(config, candidates=rows + budget - count), executor, mutator, db, progress=False)
                    count = _distinct_count(db)
                    if db.evaluated_count() == rows:  # the search stopped without a new program (stalled)
                        break
                best = db.best()
                log(f"{time.strftime('%H:%M:%S')} {run.arm}-s{run.seed}: {count}/{budget} distinct evaluated "
                    f"(+{count - before} in {time.perf_counter() - start:.0f} s), best dev {best.score:.2f}")
            finally:
                db.close()


def _mutator(config: EvolveConfig, coders: dict) -> Mutator:
    """A run's mutator; the study's LLM mutators share one loaded copy of their coder (``coders``, by name)."""
    if config.mutator not in LLM_MUTATORS:
        return make_mutator(config)
    if config.local_model not in coders:
        coders[config.local_model] = load(config.local_model, dtype=config.dtype)
    return make_mutator(config, coder=coders[config.local_model])


def _distinct_count(db: ProgramDatabase) -> int:
    return len(distinct(db.records()))


def distinct(records: Iterable[ProgramRecord]) -> list[ProgramRecord]:
    """The rows that count against a study's budget, in order: each evaluated program's first row (by code digest);
    rows that cost no evaluation (``SKIPPED``) and later rows of a program evaluated already are left out."""
    seen: set[str] = set()
    out = []
    for record in records:
        if record.status not in SKIPPED and record.code_hash not in seen:
            seen.add(record.code_hash)
            out.append(record)
    return out


def evaluated_records(path: str | Path, every_row: bool = False) -> tuple[dict, list[ProgramRecord]]:
    """A run's configuration and its distinct evaluated programs in (generation, island, slot) order (:func:`distinct`;
    ``every_row``: every row, the ones that cost nothing included)."""
    if not Path(path).is_file():
        raise ValueError(f"no program database at {path}")
    db = ProgramDatabase(path)  # SQLite's locking lets a running study go on writing it
    try:
        config = db.meta("config") or {}
        records = db.records()
    finally:
        db.close()
    return config, records if every_row else distinct(records)


def picks_at(records: list[ProgramRecord], order: tuple[str, ...], budgets: Iterable[int],
             heldout: dict[int, float] | None = None) -> dict[int, ProgramRecord | None]:
    """The rule's pick among the first N of ``records`` (a run's distinct evaluated programs), for each N of
    ``budgets``."""
    return {n: pick_among(order, records[:n], heldout) for n in budgets}


def per_request(cells: dict[str, float]) -> dict[int, float]:
    """Each request's score averaged over the ratios it was scored at (cells are keyed "sample/ratio")."""
    by_sample: dict[int, list[float]] = defaultdict(list)
    for key, value in cells.items():
        by_sample[int(key.split("/")[0])].append(value)
    return {k: float(np.mean(v)) for k, v in sorted(by_sample.items())}


class HeldoutScores:
    """Held-out scores of programs by code hash, in a JSON file written whole after each program: ``task`` (the
    decoded answers' task metric, every request at every ratio, or with ``alternate`` at one ratio each) and
    ``likelihood`` (the graded fitness on the same cells), each with its cells."""

    def __init__(self, path: str | Path, alternate: bool = False) -> None:
        self.path = Path(path)
        self.alternate = alternate  # each held-out request at one ratio, the ratios in turn (half the cost)
        self.scores: dict[str, dict] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.dev: DevSet | None = None

    def has(self, code_hash: str, measures: tuple[str, ...]) -> bool:
        return all(m in self.scores.get(code_hash, {}) for m in measures)

    def get(self, code_hash: str) -> dict:
        return self.scores[code_hash]

    def score(self, record: ProgramRecord, held: Callable[[], DevSet], limits: SandboxLimits,
              measures: tuple[str, ...] = ("task", "likelihood")) -> dict:
        """The held-out scores of ``record`` (each measure evaluated once; ``held`` builds the held-out dev set when
        first needed)."""
        entry = self.scores.setdefault(record.code_hash, {})
        missing = [m for m in measures if m not in entry]
        if missing:
            if self.dev is None:
                self.dev = held()
            program = Program(record.source)
            for fitness in missing:
                evaluation = evaluate_program(program, self.dev, limits, fitness=fitness, alternate=self.alternate)
                entry[fitness] = evaluation.score
                entry[f"{fitness}_cells"] = evaluation.cells
                entry[f"{fitness}_status"] = evaluation.status
            with written_whole(self.path) as tmp:
                tmp.write_text(json.dumps(self.scores, indent=0, sort_keys=True))
        return entry
