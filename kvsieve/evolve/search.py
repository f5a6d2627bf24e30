"""The evolution loop: islands of programs, parents from a MAP-Elites grid, children through the cascade.

Generation 0 evaluates the seed programs in every island. Each later generation proposes
``per_island`` children per island from the database as it stood when the generation began (so the
children do not depend on which sibling finished first), evaluates them through the executor and
stores each row as it finishes. Every choice is drawn from ``random.Random(f"{seed}:{generation}:
{island}:{slot}")``: a killed run resumes with the same children and the same results.
``strategy="best_of_n"`` is the control: every child is a mutation of the first seed program. With
``random_generations`` N, evolution's generations 1..N are fresh random programs (an initial population, drawn as the
random arm draws them), selection and the mutator acting from N + 1. In every case a child that
repeats an earlier program's code takes further random edits (the mutator's ``repeat_edits``: four for the
structural, random and mixed mutators, none for a language model) before it counts as a duplicate.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from kvsieve.evolve.candidate_executor import Executor
from kvsieve.evolve.cascade import Evaluation, KnownKept
from kvsieve.evolve.database import ProgramDatabase, ProgramRecord, behaviour_cell, rank_key
from kvsieve.evolve.evolve_config import EvolveConfig
from kvsieve.evolve.mutators.base import Mutator
from kvsieve.evolve.mutators.random_programs import RandomProgramMutator
from kvsieve.evolve.seeds import SEEDS
from kvsieve.language.program_source import Program
from kvsieve.language.static_check import StaticCheckError, check_source

__all__ = ["evolve", "export_best", "max_gap", "generation_summary"]

STALL_GENERATIONS = 25


def _seed_sources(config: EvolveConfig) -> list[str]:
    return [SEEDS[s] if s in SEEDS else Path(s).read_text(encoding="utf-8") for s in config.seed_programs]


def _row(evaluation: Evaluation, program: Program, generation: int, island: int, slot: int, parent_id, insp,
         mutator: str, operation: str) -> dict:
    return dict(generation=generation, island=island, slot=slot, parent_id=parent_id, inspiration_ids=insp,
                mutator=mutator, operation=operation, source=program.source, code_hash=program.code_hash,
                status=evaluation.status, stage=evaluation.stage, reason=evaluation.reason, proxy=evaluation.proxy,
                score=evaluation.score, cells=evaluation.cells, degenerate=int(evaluation.degenerate),
                cell=behaviour_cell(program.source), seconds=evaluation.seconds,
                sandbox_seconds=evaluation.sandbox_seconds, kept_hash=evaluation.kept_hash)


def _copy_row(record: ProgramRecord, generation: int, island: int, slot: int, status: str, parent_id,
              mutator: str, operation: str) -> dict:
    return dict(generation=generation, island=island, slot=slot, parent_id=parent_id, inspiration_ids=[],
                mutator=mutator, operation=operation, source=record.source, code_hash=record.code_hash,
                status=status, stage=record.stage, reason=f"same program as #{record.id}", proxy=record.proxy,
                score=record.score, cells=record.cells, degenerate=int(record.degenerate), cell=record.cell,
                kept_hash=record.kept_hash)


def max_gap(db: ProgramDatabase, config: EvolveConfig, generation: int) -> float | None:
    """Stage 2's rejection threshold for a generation: the median proxy gap of every program that reached
    stage 2 before it, rejected ones included (a child must be at least as good as half the population
    to be worth decoding; the median of the survivors alone could only tighten), and never more than
    ``max_gap_factor`` times the worst seed's gap. Computed from earlier generations only, so a resumed
    generation uses the same threshold."""
    seeds = [r.proxy for r in db.records("generation = 0 AND proxy IS NOT NULL")]
    if not seeds:
        return None
    cap = config.max_gap_factor * max(max(seeds), 0.05)
    earlier = [r.proxy for r in db.records("generation < ? AND proxy IS NOT NULL", (generation,)) if r.evaluated]
    return min(cap, statistics.median(earlier)) if earlier else cap


def evolve(config: EvolveConfig, executor: Executor, mutator: Mutator, db: ProgramDatabase,
           progress: bool = True) -> ProgramRecord | None:
    """Run (or resume) the loop until ``candidates`` programs were evaluated or the time budget ends."""
    from tqdm import tqdm

    db.check_config(config.identity())
    start = time.monotonic()
    bar = tqdm(total=config.candidates, initial=min(db.evaluated_count(), config.candidates), unit="candidate",
               desc="evolve", disable=not progress)

    def out_of_budget() -> bool:
        if db.evaluated_count() >= config.candidates:
            return True
        return config.time_budget_s is not None and time.monotonic() - start > config.time_budget_s

    # generation 0: the seed programs, evaluated once, present in every island; a budget below their count
    # stops among them (a larger budget resumes with the next seed)
    seeds = [Program(s) for s in _seed_sources(config)]
    for slot, program in enumerate(seeds):
        if not db.has_slot(0, 0, slot):
            if db.evaluated_count() >= config.candidates:
                break
            evaluation = executor.evaluate([program])[0]
            db.add(_row(evaluation, program, 0, 0, slot, None, [], "seed", config.seed_programs[slot]))
            bar.update(1)
        first = db.records("generation = 0 AND island = 0 AND slot = ?", (slot,))[0]
        for island in range(1, config.islands):
            if not db.has_slot(0, island, slot):
                db.add(_copy_row(first, 0, island, slot, "migrated", first.id, "seed", "copy"))
    if not db.scored():
        bar.close()
        raise RuntimeError("no seed program passed the cascade: " +
                           "; ".join(f"{r.operation}: {r.status} {r.reason}" for r in db.records("generation = 0")))
    generation = max(db.last_generation(), 0)
    if _generation_complete(db, config, generation):
        # a run stopped after a generation but before (or during) its migration migrates now, as the
        # uninterrupted run did (_migrate skips what is stored already)
        if generation > 0 and not out_of_budget() and _migrates(config, generation):
            _migrate(config, db, generation)
        generation += 1
    barren = 0  # consecutive generations without a new program: the mutator's neighbourhood is exhausted
    initial = RandomProgramMutator()
    while not out_of_budget():
        before = db.evaluated_count()
        # graded fitness: stage 2 is the last stage, so no threshold (it would only save decoding)
        threshold = max_gap(db, config, generation) if config.fitness == "task" else None
        proposer = initial if generation <= config.random_generations else mutator
        _run_generation(config, executor, proposer, db, generation, threshold, bar)
        barren = barren + 1 if db.evaluated_count() == before else 0
        if barren >= STALL_GENERATIONS:
            print(f"kvsieve evolve: stopped after {STALL_GENERATIONS} generations without a new program "
                  f"({db.evaluated_count()} evaluated): every proposal was a duplicate or unusable")
            break
        if out_of_budget():
            break
        if _migrates(config, generation):
            _migrate(config, db, generation)
        generation += 1
    bar.close()
    return db.best()


def _migrates(config: EvolveConfig, generation: int) -> bool:
    return config.strategy == "evolve" and config.islands > 1 and generation % config.migration_interval == 0


def _generation_complete(db: ProgramDatabase, config: EvolveConfig, generation: int) -> bool:
    if generation == 0:
        return True
    return all(db.has_slot(generation, i, s) for i in range(config.islands) for s in range(config.per_island))


def _run_generation(config, executor, mutator, db, generation, threshold, bar) -> None:
    seed_record = db.records("generation = 0 AND island = 0 AND slot = 0")[0]
    pending = []  # (program, island, slot, parent_id, inspiration ids, operation)
    for island in range(config.islands):
        elites = db.elites(island, before_generation=generation)
        best = db.best(island, before_generation=generation)
        others = [db.best(i, before_generation=generation) for i in range(config.islands) if i != island]
        for slot in range(config.per_island):
            if db.has_slot(generation, island, slot):
                continue
            rng = random.Random(f"{config.seed}:{generation}:{island}:{slot}")
            if config.strategy == "best_of_n" or generation <= config.random_generations:
                parent, pool = seed_record, []  # (initial random programs: drawn as the random arm draws them)
            else:
                parent = best if (rng.random() < config.exploit or not elites) else rng.choice(elites)
                pool = [r for r in elites + [o for o in others if o is not None] if r.code_hash != parent.code_hash]
            chosen = rng.sample(pool, min(config.inspirations, len(pool)))
            inspirations = [Program(r.source) for r in chosen]
            child = mutator.propose(Program(parent.source), inspirations, rng)
            operation = getattr(mutator, "last_operation", "") or mutator.name
            insp = [r.id for r in chosen]
            if child is None:
                db.add(dict(generation=generation, island=island, slot=slot, parent_id=parent.id, inspiration_ids=insp,
                            mutator=mutator.name, operation=operation, status="no_proposal", stage=-1,
                            reason="the mutator returned no usable program"))
                continue
            known = db.by_hash(child.code_hash, before_generation=generation)
            for _ in range(mutator.repeat_edits):  # a repeat takes another random edit (no score is read)
                if known is None:
                    break
                further = mutator.propose(child, inspirations, rng)
                if further is None:
                    break
                child = further
                operation += "+" + (getattr(mutator, "last_operation", "") or mutator.name)
                known = db.by_hash(child.code_hash, before_generation=generation)
            if known is not None:
                db.add(_copy_row(known, generation, island, slot, "duplicate", parent.id, mutator.name, operation))
                continue
            pending.append((child, island, slot, parent.id, insp, operation))
    if not pending:
        return
    room = config.candidates - db.evaluated_count()
    pending = pending[:max(room, 0)]

    def store(i: int, evaluation: Evaluation) -> None:
        child, island, slot, parent_id, insp, operation = pending[i]
        db.add(_row(evaluation, child, generation, island, slot, parent_id, insp, mutator.name, operation))
        bar.update(1)
        best = db.best()
        if best is not None:
            bar.set_postfix(best=f"{best.score:.1f}", status=evaluation.status)

    # a child keeping the entries of an earlier generation's program takes its results (siblings never count,
    # as for duplicates: the answer must not depend on which of them an interrupted run had stored)
    known = {h: KnownKept(r.id, r.proxy, r.score, r.cells) for h, r in db.by_kept_hash(generation).items()}
    executor.evaluate([p[0] for p in pending], threshold, on_result=store, known=known)


def _migrate(config: EvolveConfig, db: ProgramDatabase, generation: int) -> None:
    """Copy each island's best to the next island (ring), unless that island already has it.

    Every island's best is taken from the state before this generation's migration, so a migration
    interrupted half-way and redone on resume copies the same programs as an uninterrupted one."""
    slot = config.per_island  # a slot no child uses
    bests = {}
    for island in range(config.islands):
        rows = [r for r in db.scored(island, before_generation=generation + 1)
                if not (r.generation == generation and r.mutator == "migration")]
        bests[island] = max(rows, key=rank_key) if rows else None
    for island in range(config.islands):
        target = (island + 1) % config.islands
        best = bests[island]
        if best is None or db.has_slot(generation, target, slot):
            continue
        present = {r.code_hash for r in db.records("island = ? AND NOT (generation = ? AND mutator = 'migration')",
                                                   (target, generation))}
        if best.code_hash not in present:
            db.add(_copy_row(best, generation, target, slot, "migrated", best.id, "migration", "migration"))


def export_best(record: ProgramRecord, path: str | Path) -> Path:
    """Write the best program as a policy file (``--policies program:PATH``) after the stage-0 check."""
    try:
        check_source(record.source)
    except StaticCheckError as err:  # cannot happen for a scored program; never export one that fails
        raise RuntimeError(f"program #{record.id} fails the static check: {err}") from err
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# kvsieve evolved policy: program #{record.id} (generation {record.generation}, island "
              f"{record.island}), dev score {record.score:.1f}, proxy gap {record.proxy:.4f}\n")
    path.write_text(header + record.source, encoding="utf-8")
    return path


def generation_summary(db: ProgramDatabase) -> list[dict]:
    """Per generation: evaluated count, median score of its scored programs, best score so far."""
    out, best = [], float("-inf")
    for generation in range(db.last_generation() + 1):
        rows = [r for r in db.records("generation = ?", (generation,)) if r.evaluated]
        scores = [r.score for r in rows if r.score is not None]
        if scores:
            best = max(best, max(scores))
        out.append(dict(generation=generation, evaluated=len(rows),
                        median=statistics.median(scores) if scores else None,
                        best=best if best > float("-inf") else None))
    return out
