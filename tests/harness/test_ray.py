"""Grids and evolution candidates on Ray: rows equal the local executor's, a killed worker costs only a
retry, an interrupted driver resumes, and a candidate that kills its sandbox leaves the actor alive.

One local Ray instance (num_cpus=2) serves the module; models are the tiny random Llama of
``test_evolve.py`` (built by a picklable function, so actors build their own copy). Executors hold
actors that reserve the instance's CPUs, so each test closes the ones before it that it does not use.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from kvsieve.harness.executor import LocalGridExecutor
from kvsieve.harness.grid import GridConfig
from kvsieve.harness.ray_executor import RayGridExecutor
from kvsieve.harness.run import run_grid
from kvsieve.harness.store import TIMING_CONFIG_KEYS, ResultsStore

pytestmark = pytest.mark.ray

HERE = os.path.dirname(__file__)
# where actors and a driver subprocess find this module, test_evolve (tests/evolve) and conftest (tests)
TEST_PATHS = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "evolve")]
sys.path.extend(p for p in TEST_PATHS if p not in sys.path)  # this process too, when this file runs alone
GRID = dict(model="smollm2-135m-instruct", tasks=["niah_single_1"], lengths=[384], policies=["full", "snapkv", "knorm"],
            ratios=[0.5], samples=4)
CELLS = 4 * 3
_open: list = []  # executors whose actors hold CPUs of the module's Ray instance


def tiny_factory():
    """Builds the tiny model in whichever process calls it (an actor imports this module by name)."""
    from test_evolve import tiny_model_and_tokenizer

    return tiny_model_and_tokenizer()


def _free_cpus() -> None:
    while _open:
        _open.pop().close()


def _rows(path, drop: tuple[str, ...] = ()) -> dict:
    """Each row's values but its timings (columns and config keys; and the ``drop`` keys of its config)."""
    drop = drop + TIMING_CONFIG_KEYS
    with ResultsStore(path) as store:
        return {r.key: (r.prediction, r.score, r.kept_tokens, r.cache_bytes, r.cache_bytes_full,
                        {k: v for k, v in r.config.items() if k not in drop}) for r in store.rows()}


def _timings(path) -> dict:
    with ResultsStore(path) as store:
        return {r.key: (r.prefill_seconds, r.decode_seconds) for r in store.rows()}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The local rows are computed with the workers' one torch thread: float32 reductions split over two
    threads round differently (seen on an AMD EPYC: a proxy 0.0020466 locally, 0.0020471 on an actor)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as patch:  # workers (started by the raylet) import test modules by name
        patch.setenv("PYTHONPATH", os.pathsep.join([*TEST_PATHS, *filter(None, [os.environ.get("PYTHONPATH")])]))
        ray.init(address="local", num_cpus=2, include_dashboard=False)  # never a stale recorded cluster
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            _free_cpus()
            ray.shutdown()


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("local") / "grid.sqlite"
    run_grid(GridConfig(**GRID, store=str(path)), progress=False, executor=LocalGridExecutor(tiny_factory)).close()
    rows = _rows(path)
    assert len(rows) == CELLS
    return rows


@pytest.fixture(scope="module")
def grid_executor(cluster):
    executor = RayGridExecutor(workers=2, factory=tiny_factory)
    _open.append(executor)
    assert len(set(executor.start(GridConfig(**GRID)))) == 2  # both built before the first sample
    return executor


def test_grid_rows_equal_the_local_executor(grid_executor, local_rows, tmp_path):
    seen = []
    grid_executor.on_dispatch = lambda pid, sample: seen.append((pid, sample.id))
    store = run_grid(GridConfig(**GRID, store=str(tmp_path / "ray.sqlite")), progress=False, executor=grid_executor)
    store.close()
    assert _rows(tmp_path / "ray.sqlite") == local_rows
    assert len(seen) == 4 and len({pid for pid, _ in seen}) == 2  # both workers evaluated samples
    assert os.getpid() not in {pid for pid, _ in seen} and grid_executor.retried == []


def test_a_killed_worker_costs_one_retry_and_no_rows(grid_executor, local_rows, tmp_path):
    """SIGKILL a worker process just after a sample was sent to it, once rows have landed: the rows already
    stored stay as they are, that sample runs once more on another worker, and the run completes."""
    path = tmp_path / "killed.sqlite"
    seen, killed, before = [], [], {}

    def kill_the_third(pid: int, sample) -> None:
        seen.append((pid, sample.id))
        if len(seen) == 3:  # the first sample's rows are in (its worker got the third)
            before.update(_timings(path))
            os.kill(pid, signal.SIGKILL)
            killed.append((sample.id, pid))

    grid_executor.on_dispatch = kill_the_third
    run_grid(GridConfig(**GRID, store=str(path)), progress=False, executor=grid_executor).close()
    grid_executor.on_dispatch = None
    assert len(before) >= 3 and killed
    assert grid_executor.retried == killed  # exactly one retry: the killed worker's sample
    sample_id, dead = killed[0]
    runs = [pid for pid, sid in seen if sid == sample_id]
    assert runs[0] == dead and len(runs) == 2 and runs[1] not in (dead, -1)
    assert _rows(path) == local_rows
    after = _timings(path)
    assert {k: after[k] for k in before} == before  # kept, not recomputed
    assert dead not in grid_executor.pids()


def test_an_interrupted_driver_resumes_with_only_the_missing_cells(cluster, local_rows, tmp_path):
    """Ctrl-C (SIGINT) on a driver connected to the cluster after some samples: whole samples only are
    stored; the rerun computes just the missing cells and the rows equal an uninterrupted run."""
    _free_cpus()
    path = tmp_path / "resume.sqlite"
    grid = {**GRID, "samples": 16}
    # each dispatch waits 0.3 s in the driver, so the 14 samples left after the check take seconds: the
    # signal always lands mid-run (a fast machine finished 16 tiny samples before it, twice)
    # a process started in the background of a non-interactive shell inherits SIGINT ignored (POSIX), and so
    # would the driver: restore Python's handler so Ctrl-C raises KeyboardInterrupt wherever the test runs
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "import sys, time; sys.path[:0] = sys.argv[3].split(':'); from test_ray import tiny_factory; "
            "from kvsieve.harness.grid import GridConfig; from kvsieve.harness.run import run_grid; "
            "from kvsieve.harness.ray_executor import RayGridExecutor; "
            f"run_grid(GridConfig(**{grid!r}, store=sys.argv[1]), progress=False, "
            "executor=RayGridExecutor(address=sys.argv[2], workers=1, factory=tiny_factory, "
            "on_dispatch=lambda pid, sample: time.sleep(0.3)))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), cluster, ":".join(TEST_PATHS)],
                            stderr=subprocess.PIPE)
    # generous: on two cores busy with other work the driver's first samples took over 2 minutes
    deadline, saved = time.time() + 600, {}
    while len(saved) < 6 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
        if path.exists():
            saved = _timings(path)
    if proc.poll() is not None or len(saved) < 6:
        proc.kill()
        pytest.fail(f"the driver stored {len(saved)} rows in 600 s or ended early (exit {proc.poll()}): "
                    f"{proc.stderr.read().decode()[-3000:]}")
    proc.send_signal(signal.SIGINT)
    try:
        err = proc.communicate(timeout=60)[1].decode()
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    saved = _timings(path)
    assert 6 <= len(saved) < 48 and len(saved) % 3 == 0  # whole samples only

    executor = RayGridExecutor(address=cluster, workers=2, factory=tiny_factory)
    _open.append(executor)
    computed = []
    executor.on_dispatch = lambda pid, sample: computed.append(sample.id)
    run_grid(GridConfig(**grid, store=str(path)), progress=False, executor=executor).close()
    assert len(computed) == 16 - len(saved) // 3  # only the samples with missing cells
    rows = _rows(path, drop=("samples",))
    assert len(rows) == 48
    straight = {k: v[:5] + ({c: x for c, x in v[5].items() if c != "samples"},) for k, v in local_rows.items()}
    assert {k: v for k, v in rows.items() if k in straight} == straight  # the first 4 samples, as run straight
    after = _timings(path)
    assert {k: after[k] for k in saved} == saved


# --- evolution -------------------------------------------------------------------------------------------

# passes stage 0 (bounded loops, whitelisted calls) and would run for minutes: n^3 work, 4096 times
def _program_rows(path) -> list[tuple]:
    from kvsieve.evolve.database import ProgramDatabase

    db = ProgramDatabase(path)
    try:
        records = db.records()
        where = {r.id: (r.generation, r.island, r.slot) for r in records}
        return [(r.generation, r.island, r.slot, r.code_hash, r.status, r.stage, r.reason, r.score, r.proxy, r.cells,
                 r.degenerate, where.get(r.parent_id)) for r in records]
    finally:
        db.close()


@pytest.fixture(scope="module")
def evolve_executor(cluster, tmp_path_factory):
    from test_evolve import tiny_run_config

    from kvsieve.evolve.ray_candidate_executor import RayExecutor
    from kvsieve.evolve.sandbox import SandboxLimits

    _free_cpus()
    config = tiny_run_config(tmp_path_factory.mktemp("evolve-ray"), 4)
    executor = RayExecutor(config, SandboxLimits(timeout_s=config.sandbox_timeout_s), workers=2,
                           factory=tiny_factory)
    _open.append(executor)
    return executor


def test_evolution_on_ray_stores_the_local_executors_rows(evolve_executor, tmp_path):
    from test_evolve import tiny_model_and_tokenizer, tiny_run_config

    from kvsieve.evolve.candidate_executor import LocalExecutor
    from kvsieve.evolve.cascade import DevSet
    from kvsieve.evolve.database import ProgramDatabase
    from kvsieve.evolve.evolve_config import dev_samples
    from kvsieve.evolve.mutators.structural import StructuralMutator
    from kvsieve.evolve.search import evolve

    results = {}
    for name in ("local", "ray"):
        config = tiny_run_config(tmp_path / name, 4)
        if name == "local":
            model, tokenizer = tiny_model_and_tokenizer()
            dev = DevSet(model, tokenizer, dev_samples(config, tokenizer, config.dev_seed, config.dev_samples),
                         config.ratios, config.window)
            executor = LocalExecutor(dev, evolve_executor.limits)
        else:
            executor = evolve_executor
        db = ProgramDatabase(config.db)
        try:
            evolve(config, executor, StructuralMutator(), db, progress=False)
        finally:
            db.close()
        results[name] = _program_rows(config.db)
    assert results["ray"] == results["local"]
    evaluated = [r for r in results["ray"] if r[4] not in ("duplicate", "no_proposal", "migrated")]
    assert len(evaluated) == 4 and any(r[4] == "ok" for r in evaluated)
    assert evolve_executor.retried == []


def test_a_sandbox_killed_at_its_timeout_leaves_the_actor_alive(evolve_executor):
    """No program of the language runs without end, so the timeout is the infrastructure's guard: set below a worker's
    start-up, every try of the sandbox is killed, the evaluation fails as the sandbox's (never stored as the
    candidate's result), and the worker that ran it answers the next candidate, in the same process."""
    from dataclasses import replace

    from kvsieve.evolve.seeds import SEEDS
    from kvsieve.language.program_source import Program

    pids = evolve_executor.pids()
    limits = evolve_executor.limits
    evolve_executor.limits = replace(limits, timeout_s=0.01, startup_s=0.01)
    try:
        with pytest.raises(Exception, match="not because of the candidate"):  # noqa: B017 - Ray wraps the error
            evolve_executor.evaluate([Program(SEEDS["snapkv"])])
    finally:
        evolve_executor.limits = limits
    again = evolve_executor.evaluate([Program(SEEDS["tova"])])[0]
    assert again.status == "ok"
    assert evolve_executor.pids() == pids and evolve_executor.retried == []


def test_executor_flags_are_checked():
    from kvsieve.cli import main
    from kvsieve.evolve.evolve_config import EvolveConfig
    from kvsieve.harness.run import make_grid_executor

    assert isinstance(make_grid_executor("ray", "auto", 3), RayGridExecutor)
    with pytest.raises(ValueError, match="need --executor ray"):
        make_grid_executor("local", "auto")
    with pytest.raises(ValueError, match="workers"):
        RayGridExecutor(workers=0)
    with pytest.raises(ValueError, match="executor must be"):
        EvolveConfig(executor="dask")
    assert "executor" not in EvolveConfig(executor="ray", workers=2).identity()  # resumable anywhere
    assert main(["eval", "--policies", "full", "--samples", "1", "--ray-address", "auto"]) == 2


def test_a_dead_ray_address_is_refused_within_seconds():
    import time

    from kvsieve.distributed.cluster import connect

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"--ray-address 127.0.0.1:1: no Ray head reachable there"):
        connect("127.0.0.1:1")
    assert time.perf_counter() - start < 15
    with pytest.raises(ValueError, match=r"expected auto or HOST:PORT"):
        connect("localhost")
