"""Grid validation, the shared evaluation path, resumable runs and the CLI."""

import pytest

from kvsieve.cli import main
from kvsieve.harness.runner import Cell, GridConfig, cells_for, evaluate_sample, run_grid
from kvsieve.harness.store import ResultsStore
from kvsieve.harness.validate import validate


@pytest.mark.parametrize("changes,message", [
    (dict(policies=["snapkvv"]), "unknown policy 'snapkvv'"),
    (dict(tasks=["niah_single_9"]), "unknown task"),
    (dict(policies=[]), "grid is empty"),
    (dict(tasks=[]), "grid is empty"),
    (dict(ratios=[]), "grid is empty"),
    (dict(ratios=[1.2]), "outside"),
    (dict(lengths=[9000]), "above the context of smollm2-135m"),
    (dict(samples=0), "samples"),
    (dict(data="/no/such/file.jsonl"), "does not exist"),
])
def test_bad_grids_fail_before_any_work(changes, message):
    with pytest.raises(ValueError, match=message):
        validate(GridConfig(**changes))


def test_cells_full_runs_once_and_question_aware_variants():
    cells = cells_for(GridConfig(policies=["full", "snapkv"], ratios=[0.5, 0.75], question_aware=True,
                                 qa_policies=["oracle"]))
    assert cells.count(Cell("full", 0.0)) == 1
    assert Cell("snapkv", 0.75, True) in cells and Cell("oracle", 0.5, True) in cells
    assert len(cells) == 1 + 4 + 2


def test_cli_reports_errors_without_a_traceback(capsys):
    assert main(["eval", "--policies", "full,nope", "--samples", "1"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert main(["report", "--store", "/no/such/store.sqlite"]) == 2


@pytest.fixture(scope="module")
def smollm2():
    from kvsieve.models import load

    return load("smollm2-135m")


@pytest.fixture(scope="module")
def niah_sample(smollm2):
    from kvsieve.harness.validate import template_overhead
    from kvsieve.tasks import generate

    _, tokenizer = smollm2
    overhead = template_overhead(tokenizer, "niah_single_2", 0)
    return generate("niah_single_2", 1024, 3, lambda t: len(tokenizer(t)["input_ids"]), overhead)


@pytest.mark.model
def test_shared_path_matches_per_cell_path(smollm2, niah_sample):
    model, tokenizer = smollm2
    cells = [Cell("full", 0.0), Cell("snapkv", 0.5), Cell("knorm", 0.5), Cell("streaming_llm", 0.5),
             Cell("h2o", 0.5), Cell("pyramidkv", 0.5), Cell("adakv", 0.5), Cell("snapkv", 0.5, True),
             Cell("h2o", 0.5, True), Cell("oracle", 0.875)]
    shared = evaluate_sample(model, tokenizer, niah_sample, cells, "smollm2-135m", shared=True)
    naive = evaluate_sample(model, tokenizer, niah_sample, cells, "smollm2-135m", shared=False)
    assert [r.key for r in shared] == [r.key for r in naive]
    same = sum(a.prediction == b.prediction for a, b in zip(shared, naive))
    assert same >= len(cells) - 1, [(a.prediction, b.prediction) for a, b in zip(shared, naive)]
    for a, b in zip(shared, naive):
        assert a.kept_tokens == b.kept_tokens and a.cache_bytes == b.cache_bytes
    full, oracle = shared[0], shared[-1]
    assert full.score == 100.0
    assert oracle.score == 100.0  # keeping the needle sentence is enough at 87.5% compression
    assert oracle.cache_bytes < 0.2 * oracle.cache_bytes_full


@pytest.mark.model
def test_run_grid_is_resumable(tmp_path):
    config = GridConfig(tasks=["niah_single_1"], lengths=[512], policies=["full", "knorm"], ratios=[0.5],
                        samples=2, store=str(tmp_path / "r.sqlite"))
    store = run_grid(config, progress=False)
    assert store.count() == 4
    first = {(r.key.sample_id, r.key.policy): r.prediction for r in store.rows()}
    store.close()
    config.ratios = [0.5, 0.75]
    store = run_grid(config, progress=False)  # only the two new knorm@0.75 cells are computed
    assert store.count() == 6
    assert {(r.key.sample_id, r.key.policy): r.prediction for r in store.rows(ratio=0.5)} | \
        {(r.key.sample_id, r.key.policy): r.prediction for r in store.rows(policy="full")} == first
    store.close()
    with ResultsStore(config.store) as again:
        assert len({r.key for r in again.rows()}) == 6


@pytest.mark.model
def test_run_grid_survives_kill_9(tmp_path):
    """A grid killed with SIGKILL mid-run resumes: no lost, duplicated or recomputed rows."""
    import os
    import signal
    import subprocess
    import sys
    import time

    store_path = tmp_path / "k.sqlite"
    script = ("import sys; from kvsieve.harness.runner import GridConfig, run_grid; "
              "run_grid(GridConfig(tasks=['niah_single_1'], lengths=[512], policies=['full', 'knorm', 'snapkv'], "
              "ratios=[0.5, 0.75], samples=6, store=sys.argv[1]), progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(store_path)], stderr=subprocess.PIPE)
    deadline = time.time() + 300
    before = 0
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
        if store_path.exists():
            with ResultsStore(store_path) as store:
                before = store.count()
            if before >= 5:  # at least one sample's cells landed
                break
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with ResultsStore(store_path) as store:
        saved = {r.key: (r.prediction, r.config) for r in store.rows()}
    assert 5 <= len(saved) < 30 and len(saved) % 5 == 0  # whole samples only
    config = GridConfig(tasks=["niah_single_1"], lengths=[512], policies=["full", "knorm", "snapkv"],
                        ratios=[0.5, 0.75], samples=6, store=str(store_path))
    with run_grid(config, progress=False) as store:
        rows = store.rows()
    assert len(rows) == 30 and len({r.key for r in rows}) == 30
    assert {r.key: (r.prediction, r.config) for r in rows if r.key in saved} == saved  # kept, not recomputed
