"""Grid validation, the shared evaluation path, resumable runs and the CLI."""

import pytest

from kvsieve.cli import main
from kvsieve.harness.evaluate import evaluate_sample
from kvsieve.harness.grid import GridConfig, cells_for
from kvsieve.harness.run import run_grid
from kvsieve.harness.store import ResultsStore
from kvsieve.harness.validate import validate
from kvsieve.policies.label import Point


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
    (dict(mode="stream"), "mode 'stream' is not one of"),
    (dict(mode="decode", chunk_size=0), "chunk_size must be a positive int"),
    (dict(mode="decode", chunk_size="64"), "chunk_size is an int >= 0, got '64'"),
    (dict(mode="decode", evict_every=0), "evict_every is an int >= 1, got 0"),
    (dict(mode="decode", policies=["kvzip"]), "policy 'kvzip' cannot evict in decode mode"),
    (dict(mode="decode", question_aware=True), "question-aware cells"),
])
def test_bad_grids_fail_before_any_work(changes, message):
    with pytest.raises(ValueError, match=message):
        validate(GridConfig(**changes))


def test_cells_full_runs_once_and_question_aware_variants():
    cells = cells_for(GridConfig(policies=["full", "snapkv"], ratios=[0.5, 0.75], question_aware=True,
                                 qa_policies=["oracle"]))
    assert cells.count(Point("full", 0.0)) == 1
    assert Point("snapkv", 0.75, True) in cells and Point("oracle", 0.5, True) in cells
    assert len(cells) == 1 + 4 + 2


def test_decode_cells_are_stored_under_their_own_label():
    cells = cells_for(GridConfig(policies=["full", "h2o"], ratios=[0.5], mode="decode", chunk_size=64))
    assert [c.stored for c in cells] == ["full@decode64", "h2o@decode64"]
    assert [c.stored for c in cells_for(GridConfig(policies=["h2o"], ratios=[0.5]))] == ["h2o"]


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
    from kvsieve.tasks import generate
    from kvsieve.tasks.load import template_overhead

    _, tokenizer = smollm2
    overhead = template_overhead(tokenizer, "niah_single_2", 0)
    return generate("niah_single_2", 1024, 3, lambda t: len(tokenizer(t)["input_ids"]), overhead)


@pytest.mark.model
def test_shared_path_matches_per_cell_path(smollm2, niah_sample):
    """Every cell of the shared path (one prefill, pruned copies, one decode batch per ratio) equals the
    naive per-cell path: same kept tokens, bytes, prediction and score. In float32: in bf16 a padded
    decode batch runs other kernels than one row and can flip near-tie tokens (the runner's comment;
    benchmarks/grid_speed.py measures it), which is a property of bf16 batching, not of the sharing."""

    model, tokenizer = smollm2
    cells = [Point("full", 0.0), Point("snapkv", 0.5), Point("knorm", 0.5), Point("streaming_llm", 0.5),
             Point("h2o", 0.5), Point("pyramidkv", 0.5), Point("adakv", 0.5), Point("chunkkv", 0.5), Point("tova", 0.5),
             Point("expected_attention", 0.5), Point("snapkv", 0.5, True), Point("h2o", 0.5, True),
             Point("expected_attention", 0.5, True), Point("oracle", 0.875)]
    shared = evaluate_sample(model, tokenizer, niah_sample, cells, "smollm2-135m", shared=True)
    naive = evaluate_sample(model, tokenizer, niah_sample, cells, "smollm2-135m", shared=False)
    assert [r.key for r in shared] == [r.key for r in naive]
    for a, b in zip(shared, naive):
        assert (a.prediction, a.score, a.kept_tokens, a.cache_bytes, a.cache_bytes_full) == \
            (b.prediction, b.score, b.kept_tokens, b.cache_bytes, b.cache_bytes_full), a.key
    for r in shared:  # each shared cell timed its sample's prefill and its own compression in this process
        t = r.config
        assert t["prefill_only_seconds"] > 0 and t["compress_seconds"] >= 0, r.key
        assert r.prefill_seconds == pytest.approx(t["prefill_only_seconds"] + t["compress_seconds"]), r.key
    assert "compress_seconds" not in naive[0].config
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


def test_an_interrupted_sample_keeps_the_batches_it_decoded(tmp_path, monkeypatch):
    # rows land per decoded batch, not per sample: an interrupt loses only the batch in flight
    from conftest import CharTokenizer, tiny_model

    import kvsieve.harness.evaluate as evaluate_module
    from kvsieve.harness.executor import LocalGridExecutor

    def grid(name: str) -> GridConfig:
        return GridConfig(model="tiny", tasks=["niah_single_1"], lengths=[480], policies=["full", "knorm", "tova"],
                          ratios=[0.5, 0.75], samples=1, store=str(tmp_path / name))

    def executor() -> LocalGridExecutor:
        return LocalGridExecutor(factory=lambda: (tiny_model("llama"), CharTokenizer()))

    real, calls = evaluate_module.greedy_decode, []

    def decode_then_stop(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "greedy_decode", decode_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run_grid(grid("r.sqlite"), progress=False, executor=executor())
    with ResultsStore(tmp_path / "r.sqlite") as store:
        assert sorted((k.policy, k.ratio) for k in store.keys()) == [("full", 0.0), ("knorm", 0.5), ("tova", 0.5)]
        kept = {r.key: r.prediction for r in store.rows()}
    monkeypatch.setattr(evaluate_module, "greedy_decode", real)
    with run_grid(grid("r.sqlite"), progress=False, executor=executor()) as store:
        resumed = {r.key: r.prediction for r in store.rows()}
    with run_grid(grid("whole.sqlite"), progress=False, executor=executor()) as store:
        whole = {r.key: r.prediction for r in store.rows()}
    assert len(resumed) == 5 and resumed == whole and kept.items() <= resumed.items()


@pytest.mark.model
def test_run_grid_survives_kill_9(tmp_path):
    """A grid killed with SIGKILL mid-run resumes: no lost, duplicated or recomputed rows."""
    import os
    import signal
    import subprocess
    import sys
    import time

    store_path = tmp_path / "k.sqlite"
    script = ("import sys; from kvsieve.harness.grid import GridConfig; from kvsieve.harness.run import run_grid; "
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
    cells_per_ratio = {0.0: 1, 0.5: 2, 0.75: 2}  # full; knorm and snapkv, decoded in one batch per ratio
    landed = {}
    for key in saved:
        landed.setdefault((key.sample_id, key.ratio), []).append(key.policy)
    assert 5 <= len(saved) < 30
    assert all(len(policies) == cells_per_ratio[ratio] for (_, ratio), policies in landed.items())  # whole batches
    config = GridConfig(tasks=["niah_single_1"], lengths=[512], policies=["full", "knorm", "snapkv"],
                        ratios=[0.5, 0.75], samples=6, store=str(store_path))
    with run_grid(config, progress=False) as store:
        rows = store.rows()
    assert len(rows) == 30 and len({r.key for r in rows}) == 30
    assert {r.key: (r.prediction, r.config) for r in rows if r.key in saved} == saved  # kept, not recomputed


def test_ragged_caches_decode_in_one_batch_as_they_do_alone():
    """PyramidKV (per-layer lengths), AdaKV (per-head masks) and SnapKV at another ratio share one batch."""
    import torch
    from conftest import tiny_model

    import kvsieve
    from kvsieve.engine.cache import clone_cache, stack_caches
    from kvsieve.engine.compress import compress_cache
    from kvsieve.engine.generate import greedy_decode
    from kvsieve.policies import FullCache
    from kvsieve.selection import Budget

    class Ids:
        eos_token_id = None

        def decode(self, ids, **_):
            return " ".join(map(str, ids))

    model = tiny_model("llama")
    prompt = torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(3))
    question = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    points = [("pyramidkv", 0.5), ("adakv", 0.5), ("snapkv", 0.75)]
    with kvsieve.attach(model, FullCache(window=16), ratio=0.0):
        full = model(input_ids=prompt, use_cache=True).cache
        pruned = []
        for name, ratio in points:
            cache = clone_cache(full)
            compress_cache(cache, kvsieve.policies.get(name, window=16), Budget(ratio=ratio), 0)
            pruned.append(cache)
        lengths = {tuple(layer.keys.shape[-2] for layer in c.layers) for c in pruned}
        assert len(lengths) == 3  # really ragged

        def answer(caches):
            batch = stack_caches(caches)
            logits = model(input_ids=question.expand(len(caches), -1), cache=batch, use_cache=True).logits[:, -1]
            return greedy_decode(model, Ids(), batch, logits, 8)

        alone = [answer([clone_cache(c)])[0] for c in pruned]
        together = answer([clone_cache(c) for c in pruned])
    assert together == alone


@pytest.mark.parametrize("samples,expected", [(None, 7), (3, 3)])
def test_data_file_uses_every_sample_unless_told(tmp_path, samples, expected):
    from kvsieve.tasks.load import load_samples
    from kvsieve.tasks.ruler import generate
    from kvsieve.tasks.sample import write_jsonl

    path = tmp_path / "s.jsonl"
    write_jsonl([generate("niah_single_1", 300, seed, lambda t: len(t) // 4) for seed in range(7)], path)
    config = GridConfig(data=str(path), samples=samples)
    validate(config)
    assert len(list(load_samples(config.sample_spec(), tokenizer=None))) == expected


def test_a_decode_batch_drops_rows_of_caches_captured_with_query_statistics():
    """The runner's capture keeps pre-RoPE query statistics (ExpectedAttention); a stacked decode batch must
    still drop finished rows (it once indexed the one-row statistics with the batch's row numbers)."""
    import torch
    from conftest import tiny_model

    import kvsieve
    from kvsieve.engine.cache import clone_cache, stack_caches
    from kvsieve.policies import FullCache

    model = tiny_model("llama")
    prompt = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    capture = FullCache(window=8)
    capture.needs_query_stats = True
    with kvsieve.attach(model, capture, ratio=0.0):
        full = model(input_ids=prompt, use_cache=True).cache
        assert full.layers[0].query_stats is not None
        batch = stack_caches([clone_cache(full), clone_cache(full), clone_cache(full)])
        batch.batch_select_indices(torch.tensor([0, 2]))
    assert all(layer.keys.shape[0] == 2 for layer in batch.layers)


@pytest.mark.model
def test_decode_mode_grid_evicts_while_reading_and_shares_the_store_with_prefill_rows(tmp_path):
    from kvsieve.selection import Budget

    store_path = str(tmp_path / "r.sqlite")
    base = dict(tasks=["niah_single_1"], lengths=[1024], policies=["full", "h2o"], ratios=[0.75], samples=1,
                store=store_path)
    run_grid(GridConfig(**base), progress=False).close()
    with run_grid(GridConfig(**base, mode="decode", chunk_size=128), progress=False) as store:
        rows = {r.key.policy: r for r in store.rows()}
    assert set(rows) == {"full", "h2o", "full@decode128", "h2o@decode128"}
    context = rows["full"].config["context_tokens"]
    budget = Budget(ratio=0.75).resolve(context)
    decoded = rows["h2o@decode128"]
    # decode-time eviction holds at most the budget plus one chunk; the prefill row keeps exactly the budget
    assert budget <= decoded.kept_tokens <= budget + 128 and rows["h2o"].kept_tokens == budget
    # the full-cache bytes are those of the whole context in both modes
    assert decoded.cache_bytes_full == rows["h2o"].cache_bytes_full == rows["full@decode128"].cache_bytes
    assert decoded.cache_bytes < 0.5 * decoded.cache_bytes_full
    assert rows["full@decode128"].kept_tokens == context


def test_policy_lists_split_on_top_level_commas_only(capsys):
    from kvsieve.policies import split_specs

    assert split_specs("full, snapkv(window=32, chunk_size=4),learned(checkpoint='a,b'),") == \
        ["full", "snapkv(window=32, chunk_size=4)", "learned(checkpoint='a,b')"]
    # the policies pass validation (checked before the lengths), so the error is the length's
    assert main(["eval", "--policies", "full,snapkv(window=32, chunk_size=4)", "--lengths", "9000"]) == 2
    assert "above the context" in capsys.readouterr().err
