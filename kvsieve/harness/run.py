"""The run loop: every missing cell of a grid, through an executor, into the results store.

Resumable by construction: the store says which cells are missing, rows land as they are decoded (each
batch of one ratio in one transaction; on Ray each sample's), so a run stopped at any moment (Ctrl-C, a
lost machine) loses at most the batch in flight and is continued by rerunning it;
one computing in another dtype than the store's rows is refused (``content.check_dtype``).

A policy that fails a cell (``harness/evaluate.py``) is stored as a failed cell with its reason and the run goes
on; programs interpreted in this process share one budget of seconds for the whole run
(``GridConfig.program_budget_s``): once spent, each further program cell fails at once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tqdm import tqdm

from kvsieve.harness.content import check_dtype, check_store
from kvsieve.harness.executor import LocalGridExecutor
from kvsieve.harness.grid import GridConfig, cells_for
from kvsieve.harness.ray_executor import RayGridExecutor
from kvsieve.harness.store import CellKey, CellResult, FailedCell, ResultsStore
from kvsieve.harness.validate import validate
from kvsieve.policies.program import run_budget
from kvsieve.tasks.sample import Sample

__all__ = ["run_grid", "recorded_config", "make_grid_executor", "EXECUTORS"]

EXECUTORS = ("local", "ray")


def run_grid(config: GridConfig, progress: bool = True, executor=None) -> ResultsStore:
    """Evaluate every missing cell of the grid; rows land in the store as they are decoded.

    ``executor`` (``harness/executor.py``) computes the samples: in this process (``None``: a
    ``LocalGridExecutor``, closed here) or on Ray actors (``RayGridExecutor``; the caller closes it).
    Only this process writes the store.
    """
    validate(config)
    cells = cells_for(config)
    store = ResultsStore(config.store)
    owned = executor is None
    executor = LocalGridExecutor() if owned else executor
    try:
        check_store(store, config.model, {c.stored: c.policy_spec.digest for c in cells})
        samples = executor.samples(config)
        check_dtype(store, config.model, executor.dtype(config))
        todo = []
        for sample in samples:
            keys = {c: CellKey.of(config.model, sample.task, sample.length, sample.id, c) for c in cells}
            missing = set(store.missing(list(keys.values())))
            todo_cells = [c for c in cells if keys[c] in missing]
            if todo_cells:
                todo.append((sample, todo_cells))
        total = sum(len(c) for _, c in todo)
        bar = tqdm(total=total, unit="cell", disable=not progress, desc=f"{config.model}")
        run_config = recorded_config(config, samples)

        def on_rows(results: list[CellResult | FailedCell]) -> None:
            failures = [r for r in results if isinstance(r, FailedCell)]
            store.add_many(r for r in results if not isinstance(r, FailedCell))  # a decoded batch lands together
            store.add_failed(failures)
            for failure in failures:
                bar.write(f"failed cell {failure.key.policy} at ratio {failure.key.ratio:g} "
                          f"({failure.key.task}/{failure.key.length}/{failure.key.sample_id}): {failure.reason}")
            bar.update(len(results))

        try:
            with run_budget(config.program_budget_s):  # programs interpreted in this process, all cells together
                executor.run(config, todo, run_config, on_rows)
        finally:
            bar.close()
    except ValueError:  # a refused store (other file contents, another dtype): the caller never gets it
        store.close()
        raise
    finally:
        if owned:
            executor.close()
    return store


def recorded_config(config: GridConfig, samples: list[Sample]) -> dict:
    """The configuration each row records: what ran. A grid reading ``data`` runs the file's tasks and lengths, not
    the generator's (unused) defaults, so those are replaced by the samples' own, with the file's sha256 beside."""
    out = {k: v for k, v in config.as_dict().items() if k != "store"}
    if config.data:
        out["tasks"] = sorted({s.task for s in samples})
        out["lengths"] = sorted({int(s.length) for s in samples})
        out["samples"] = len(samples)
        out["data_sha256"] = hashlib.sha256(Path(config.data).read_bytes()).hexdigest()
    return out


def make_grid_executor(kind: str = "local", address: str | None = None,
                       workers: int | None = None) -> LocalGridExecutor | RayGridExecutor:
    """The executor ``--executor`` names; ``--ray-address`` and ``--workers`` only apply to Ray."""
    if kind == "local":
        if address is not None or workers is not None:
            raise ValueError("--ray-address and --workers need --executor ray")
        return LocalGridExecutor()
    if kind == "ray":
        return RayGridExecutor(address=address, workers=workers)
    raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {kind!r}")
