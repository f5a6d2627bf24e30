"""A failed cell, not a failed run (issue 41): a policy that errors, exceeds a budget, scores NaN or whose
SELECTION does not fit one ratio fails that cell with its reason; the store keeps it apart, the report counts
it outside every mean, and the other cells of the run complete.

The tiny model reads ~300 context tokens (CharTokenizer, length 480), so the issue's "64 sinks at ratio 0.95" is
rebuilt at ratio 0.75: 75 entries kept, enough for snapkv's window of 64, not for 64 sinks plus that window."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CharTokenizer, tiny_model

from kvsieve.harness.evaluate import evaluate_sample
from kvsieve.harness.executor import LocalGridExecutor
from kvsieve.harness.grid import GridConfig
from kvsieve.harness.report import report_text
from kvsieve.harness.run import run_grid
from kvsieve.harness.store import CellResult, FailedCell
from kvsieve.language.interpreter import InterpreterError, LimitExceeded, ProgramFailed
from kvsieve.policies.label import Point
from kvsieve.policies.program import ProgramPolicy
from kvsieve.signals import Signals
from kvsieve.tasks.ruler import generate

torch.set_num_threads(1)

HEADER = 'SELECTION = {"chunk_size": 1, "sink": 0}\n'
NAN = HEADER + "def score(f):\n    return group_mean(f.attn) * 0.0 / 0.0\n"
SINK64 = 'SELECTION = {"chunk_size": 1, "sink": 64}\ndef score(f):\n    return group_mean(f.attn)\n'
# the hoarder: 64 float32 copies of f.attn held at once, 16.8 times the elements the call receives (b h (2g + 3) n + n)
# where the budget is 16 times: refused by the cost model at every length, before it runs
HOARDER = HEADER + "def score(f):\n" + "".join(f"    a{i} = f.attn * {i + 1}\n" for i in range(64)) + (
    "    return group_mean(" + " + ".join(f"a{i}" for i in range(64)) + ")\n")
HOARDER_RETURN_LINE = 67


@pytest.fixture
def programs(tmp_path):
    paths = {}
    for name, source in (("nan", NAN), ("sink64", SINK64), ("sleeper", HOARDER)):
        paths[name] = tmp_path / f"{name}.py"
        paths[name].write_text(source)
    return paths


def _signals(n: int) -> Signals:
    g = torch.Generator().manual_seed(n)
    keys, values = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    return Signals(keys=keys, values=values, window_queries=torch.randn(1, 6, 4, 8, generator=g),
                   positions=torch.arange(n).expand(1, 2, n), layer_idx=0, num_layers=2, scaling=8**-0.5)


def test_a_program_policy_raises_one_exception_type_for_whatever_the_program_causes(programs):
    """What a caller (the harness, the server answering at full KV) catches: InterpreterError, a ValueError."""
    with pytest.raises(ProgramFailed, match="not all finite"):
        ProgramPolicy(path=str(programs["nan"]), window=4).score(_signals(64))
    # b h g n = 1 * 2 * 3 * 201 elements of 4 bytes, 65 held at once on the return line (a0 + a1 and a0..a63)
    held = f"{65 * 1206 * 4 / 2**20:.1f}"
    with pytest.raises(LimitExceeded, match=rf"sleeper.py line {HOARDER_RETURN_LINE}: limit: {held} MiB live at once, "
                                            r"over the budget of 0.2 MiB at b = 1, h = 2, g = 3, n = 201"):
        ProgramPolicy(path=str(programs["sleeper"]), window=4).score(_signals(201))
    wrong = HEADER + "def score(f):\n    return f.position\n"
    with pytest.raises(ValueError, match=r"line 3: score must return scores shaped \(b, h, n\), this returns \(n\)"):
        ProgramPolicy(source=wrong, window=4)
    for err in (ProgramFailed, LimitExceeded):
        assert issubclass(err, InterpreterError) and issubclass(err, ValueError)


def test_failing_policies_fail_their_cells_and_the_sample_goes_on(programs):
    sample = generate("niah_single_1", 480, 0, lambda text: len(text))
    cells = [Point("full", 0.0), Point("snapkv", 0.5), Point(f"program:{programs['nan']}", 0.5),
             Point(f"program:{programs['sink64']}", 0.5), Point(f"program:{programs['sink64']}", 0.75),
             Point(f"program:{programs['sleeper']}", 0.5), Point("snapkv", 0.75)]
    landed = []
    out = evaluate_sample(tiny_model("llama"), CharTokenizer(), sample, cells, "tiny", on_rows=landed.extend)
    assert [r.key.policy for r in out] == [c.stored for c in cells] and len(landed) == len(cells)
    failed = {(r.key.policy.split("/")[-1], r.key.ratio): r.reason for r in out if isinstance(r, FailedCell)}
    scored = {(r.key.policy.split("/")[-1], r.key.ratio) for r in out if isinstance(r, CellResult)}
    assert scored == {("full", 0.0), ("snapkv", 0.5), ("sink64.py", 0.5), ("snapkv", 0.75)}
    assert set(failed) == {("nan.py", 0.5), ("sink64.py", 0.75), ("sleeper.py", 0.5)}
    assert "not all finite" in failed[("nan.py", 0.5)]
    assert "MiB live at once, over the budget" in failed[("sleeper.py", 0.5)]
    assert f"line {HOARDER_RETURN_LINE}" in failed[("sleeper.py", 0.5)]
    # 64 sinks and the window of 64: 128 protected entries, more than the quarter of the context kept
    assert "below the 128 protected ones (sink=64" in failed[("sink64.py", 0.75)], failed[("sink64.py", 0.75)]


def test_a_grid_stores_failed_cells_apart_reports_them_and_retries_them(programs, tmp_path):
    config = GridConfig(model="tiny", tasks=["niah_single_1"], lengths=[480], samples=2, ratios=[0.5, 0.75],
                        policies=["full", "snapkv", f"program:{programs['sink64']}", f"program:{programs['nan']}"],
                        store=str(tmp_path / "r.sqlite"))
    executor = LocalGridExecutor(factory=lambda: (tiny_model("llama"), CharTokenizer()))
    with run_grid(config, progress=False, executor=executor) as store:
        rows, failures = store.rows(), store.failed()
        # 2 samples x (full + snapkv at 2 ratios + sink64 at 0.5) scored; sink64 at 0.75 and nan at both failed
        assert len(rows) == 2 * 4 and len(failures) == 2 * 3
        assert all(math.isfinite(r.score) for r in rows)
        text = report_text(rows, failures=failures, allow_mixed_machines=True)
        assert "## failed cells (tiny): 6, not in any mean" in text
        sink = str(programs["sink64"])
        assert f"| program:{sink} | 0.75 | 2 | 0 |" in text and f"| program:{sink} | 0.5 |" not in text
        assert f"| program:{programs['nan']} | 0.5 | 2 | 0 | ProgramFailed: program" in text
        failed_keys = {f.key for f in failures}
        assert set(store.missing(list(failed_keys))) == failed_keys  # a rerun retries them
    with run_grid(config, progress=False, executor=executor) as store:  # the rerun fails them again, stores once
        assert store.count() == 8 and len(store.failed()) == 6


def test_a_runs_program_budget_fails_the_cells_after_it_is_spent(programs, tmp_path):
    # 200 operations, each well within its budget: the run's shared wall-clock budget (1 ms) stops the first call
    terms = "".join(f" + {i} * f.key_norm" for i in range(100))
    slow = HEADER + f"def score(f):\n    return group_mean(f.attn){terms}\n"
    path = tmp_path / "slow.py"
    path.write_text(slow)
    config = GridConfig(model="tiny", tasks=["niah_single_1"], lengths=[480], samples=2, ratios=[0.5],
                        policies=["full", "snapkv", f"program:{path}"], store=str(tmp_path / "b.sqlite"),
                        program_budget_s=0.001)
    executor = LocalGridExecutor(factory=lambda: (tiny_model("llama"), CharTokenizer()))
    with run_grid(config, progress=False, executor=executor) as store:
        assert {r.key.policy for r in store.rows()} == {"full", "snapkv"}
        reasons = [f.reason for f in store.failed()]
        assert len(reasons) == 2 and all("the run's budget of 0.001 s for programs" in r for r in reasons)
    with pytest.raises(ValueError, match="program_budget_s must be"):
        GridConfig(program_budget_s=0)


@pytest.mark.parametrize("shared", [True, False])
def test_a_hand_made_policy_scoring_nan_fails_its_cell_through_the_engine(monkeypatch, shared):
    """Not only programs (which refuse NaN themselves): the engine refuses NaN from any policy, so a registry family
    (here snapkv, its scores poisoned in layer 1) fails its cell with the policy and layer named, shared or not."""
    from kvsieve.policies.snapkv import SnapKV

    score = SnapKV.score

    def nan_in_layer_1(self, signals):
        scores = score(self, signals)
        return scores.fill_(float("nan")) if signals.layer_idx == 1 else scores

    monkeypatch.setattr(SnapKV, "score", nan_in_layer_1)
    sample = generate("niah_single_1", 300, 0, lambda text: len(text))  # unshared: within 512
    cells = [Point("full", 0.0), Point("snapkv", 0.5), Point("tova", 0.5)]
    out = evaluate_sample(tiny_model("llama"), CharTokenizer(), sample, cells, "tiny", shared=shared)
    assert [type(r).__name__ for r in out] == ["CellResult", "FailedCell", "CellResult"]
    reason = out[1].reason
    assert reason.startswith("ValueError: policy 'snapkv' scored ") and "NaN and 0 -inf in layer 1" in reason
