"""``kvsieve evolve``: load the model, prefill the dev set, run or resume the loop, export and report."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsieve.evolve.candidate_executor import LocalExecutor
from kvsieve.evolve.cascade import DevSet, evaluate_program
from kvsieve.evolve.database import ProgramDatabase, ProgramRecord, rank_key
from kvsieve.evolve.evolution_report import smoke_note, write_report
from kvsieve.evolve.evolve_config import EvolveConfig, dev_samples
from kvsieve.evolve.mutators import make_mutator
from kvsieve.evolve.ray_candidate_executor import RayExecutor
from kvsieve.evolve.sandbox import SandboxLimits, require_isolation
from kvsieve.evolve.search import evolve, export_best
from kvsieve.language.program_source import Program
from kvsieve.models import dtype_name, load

__all__ = ["EvolveResult", "heldout_programs", "run_evolution"]


@dataclass
class EvolveResult:
    best: ProgramRecord | None
    best_path: Path | None
    report: Path
    heldout: dict[int, float]


def run_evolution(config: EvolveConfig, progress: bool = True, model=None, tokenizer=None) -> EvolveResult:
    """Run or resume ``config``; the database at ``config.db`` holds everything needed to resume.

    The sandbox's isolation is checked first (``config.sandbox == "strict"`` refuses anything below
    full isolation; the default warns), printed, and stored in the database and the report."""
    # Ray's actors compute with one torch thread each (one CPU apiece); the driver's dev set and held-out scores then
    # use that count too, so the actors read its saved prefills and the database records the count of every row
    threads = 1 if config.executor == "ray" else torch.get_num_threads()
    with _only_run_on(Path(config.db)), _torch_threads(threads):
        return _run(config, progress, model, tokenizer, threads)


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """torch computes with ``count`` threads inside, and with the count it had before after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _only_run_on(db_path: Path) -> Iterator[None]:
    """Hold ``DB.lock`` for the run: a second ``kvsieve evolve`` on the same database would fill the same
    generations' slots twice, so it is refused while this one runs (an advisory lock the OS drops when this
    process ends, however it ends)."""
    lock = db_path.with_name(db_path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise RuntimeError(f"another kvsieve evolve (pid {holder}) is running on {db_path} (it holds {lock}): "
                               "wait for it to finish or stop it, then rerun to resume") from None
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        yield


def _run(config: EvolveConfig, progress: bool, model, tokenizer, threads: int) -> EvolveResult:
    isolation = require_isolation(config.sandbox)
    print(f"kvsieve evolve: sandbox isolation {isolation['level']}"
          f"{' + seccomp' if isolation['seccomp'] else ' (no seccomp filter)'}, worker uid {isolation['worker_uid']}")
    db = ProgramDatabase(config.db)
    try:
        db.check_config(config.identity())  # before any model work: a mismatched database fails fast
        db.set_meta("isolation", isolation)
        if model is None:
            model, tokenizer = load(config.model, dtype=config.dtype)
        db.check_numerics(dtype_name(model), threads)  # before the dev cache, which holds its answers
        dev = DevSet(model, tokenizer, dev_samples(config, tokenizer, config.dev_seed, config.dev_samples),
                     config.ratios, config.window, config.dev_cache_folder, progress=progress,
                     surrogate=config.surrogate)
        limits = SandboxLimits(timeout_s=config.sandbox_timeout_s, memory_mb=config.sandbox_memory_mb)
        if config.executor == "ray":  # actors build their own model and dev set; the database stays here
            executor = RayExecutor(config, limits, address=config.ray_address, workers=config.workers,
                                   cpus_per_worker=threads)
        else:
            executor = LocalExecutor(dev, limits, config.fitness, config.dev_cells == "alternate")
        mutator = make_mutator(config, model, tokenizer)
        if hasattr(mutator, "score_of"):  # LLM prompts show the parent's and inspirations' dev scores
            mutator.score_of = db.score_of
        try:
            best = evolve(config, executor, mutator, db, progress=progress)
        finally:
            executor.close()  # Ray: its actors, and the Ray instance it started
        heldout = _heldout_scores(db, config, model, tokenizer, limits, progress)
        reference = {"full cache (dev)": dev.full_score}
        for record in db.records("generation = 0 AND island = 0"):
            reference[f"seed {record.operation} (dev)"] = record.score if record.score is not None else float("nan")
        best_path = export_best(best, Path(config.out) / "best.py") if best is not None else None
        report = write_report(db, config, config.out, heldout, reference)
        note = smoke_note(config)
        if note:  # as the run ends, just above the best program's scores it is about
            print(note)
        return EvolveResult(best, best_path, report, heldout)
    finally:
        db.close()


def heldout_programs(db: ProgramDatabase, top: int) -> list[ProgramRecord]:
    """The seeds, then the ``top`` best distinct programs in the order that picks the run's best
    (``rank_key``: score, then the smaller proxy gap), so the exported best always gets a held-out score."""
    wanted = list(db.records("generation = 0 AND island = 0"))
    seen = {r.code_hash for r in wanted}
    limit = len(wanted) + top
    for record in sorted(db.scored(), key=rank_key, reverse=True):
        if len(wanted) >= limit:
            break
        if record.code_hash not in seen:
            wanted.append(record)
            seen.add(record.code_hash)
    return wanted


def _heldout_scores(db: ProgramDatabase, config: EvolveConfig, model, tokenizer, limits, progress: bool,
                    top: int = 3) -> dict[int, float]:
    """Task scores on held-out seeds of the seed programs and the ``top`` best programs (cached in the db)."""
    row = db.conn.execute("SELECT value FROM meta WHERE key = 'heldout'").fetchone()
    cached = {int(k): v for k, v in json.loads(row[0]).items()} if row else {}
    todo = [r for r in heldout_programs(db, top) if r.id not in cached and r.source]
    if todo:
        held = DevSet(model, tokenizer, dev_samples(config, tokenizer, config.heldout_seed, config.heldout_samples),
                      config.ratios, config.window, Path(config.out) / "heldout-cache", progress=progress,
                      surrogate=config.surrogate)
        for record in todo:
            evaluation = evaluate_program(Program(record.source), held, limits)
            cached[record.id] = evaluation.score if evaluation.score is not None else float("nan")
        with db.conn:
            db.conn.execute("INSERT OR REPLACE INTO meta VALUES ('heldout', ?)", (json.dumps(cached),))
    return cached
