"""The cost model: a program's memory and time are known from its typed graph before it runs (issue 48).

Expected sizes are derived here by hand from the shapes; a program over a budget is refused before its first
operation (no cost is recorded: nothing ran), at every length; every shipped program scores bitwise as the same
text run as trusted Python would.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvsieve.evolve.seeds import SEEDS
from kvsieve.language import operations as ops
from kvsieve.language import program_features as feats
from kvsieve.language.cost import CALIBRATION, CALL_OVERHEAD_NS, dims_of, predict
from kvsieve.language.interpreter import (
    InterpreterError,
    LimitExceeded,
    ProgramFailed,
    ScoreProgram,
    WallClockExceeded,
    run_budget,
    work_growth,
)
from kvsieve.language.program_features import synthetic_features
from kvsieve.language.static_check import StaticCheckError, check_source

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "results" / "evolve").rglob("*.py"))
HOARDER = "def score(f):\n" + "".join(f"    a{i} = f.attn * {i + 1}\n" for i in range(64)) + (
    "    return group_mean(" + " + ".join(f"a{i}" for i in range(64)) + ")\n")


def body(*lines: str) -> str:
    return "def score(f):\n" + "".join(f"    {line}\n" for line in lines)


def features(n: int, group: int = 7, kv_heads: int = 2):
    return synthetic_features(0, batch=1, kv_heads=kv_heads, group=group, n=n, window=64)


def test_peak_bytes_and_time_match_a_hand_derivation():
    graph = ScoreProgram(body("a = group_mean(f.attn)", "return a * 2.0 + a")).graph
    b, h, g, n = 1, 2, 3, 100
    p = predict(graph, dims_of(b, h, g, n))
    out = b * h * n * 4  # bytes of one (b, h, n) float32 tensor
    # a (live), a * 2 (live while the sum is made), the sum: three at once, then a and a * 2 are dropped
    assert p.peak_bytes == 3 * out and p.largest_tensor == out
    group, binary = CALIBRATION["group"], CALIBRATION["binary"]
    expected = (CALL_OVERHEAD_NS + group.overhead_ns + group.ns_per_element * b * h * g * n  # reads all of attn
                + 2 * (binary.overhead_ns + binary.ns_per_element * b * h * n))
    assert p.total_ns == pytest.approx(expected)


def test_rank_and_pools_are_priced_by_their_sort_and_kernel():
    dims = dims_of(1, 8, 4, 32768)
    rank = predict(ScoreProgram(body("return rank(f.key_norm)")).graph, dims)
    cal = CALIBRATION["rank"]
    # log2 32768 = 15 sort passes over the 8 * 32768 entries
    assert rank.total_ns == pytest.approx(CALL_OVERHEAD_NS + cal.overhead_ns + cal.ns_per_element * 15 * 8 * 32768)
    pooled = [predict(ScoreProgram(body(f"return pool(f.key_norm, {k})")).graph, dims).total_ns for k in (1, 257)]
    assert pooled[1] - pooled[0] == pytest.approx(CALIBRATION["pool"].ns_per_kernel * 256 * 8 * 32768)


@pytest.mark.parametrize("n", [256, 4096, 32768])
def test_the_hoarder_is_refused_before_it_runs_at_every_length(n):
    # 64 copies of attn, 64 * 2 * 7 * n elements, against 16 x the (2 * 7 + 3) * 2 * n + n elements received
    program = ScoreProgram(HOARDER)
    held = 65 * 2 * 7 * n * 4
    budget = 16 * max((2 * 7 + 3) * 2 * n + n, 1 << 12) * 4
    assert held > budget
    with pytest.raises(LimitExceeded, match=rf"<program> line 66: limit: {held / 2**20:.1f} MiB live at once"):
        program(features(n))
    assert program.last_cost is None  # nothing ran
    with pytest.raises(StaticCheckError, match="live at once, over the budget"):  # and stage 0 prices it at 32k
        check_source(HOARDER)


def _shipped() -> list[tuple[str, str]]:
    return [(p.name, p.read_text()) for p in SHIPPED] + [(f"seed {k}", s) for k, s in SEEDS.items()]


def _as_trusted_python(source: str):
    """The independent reference: the (trusted, shipped) text run as Python with the helpers in scope."""
    namespace = {"torch": torch, **feats.HELPERS}
    exec(compile(source, "<shipped>", "exec"), namespace)  # noqa: S102 - test only, files of this repository
    return namespace["score"]


@pytest.mark.parametrize("name,source", _shipped(), ids=[name for name, _ in _shipped()])
def test_every_shipped_program_scores_as_its_text_run_as_python_well_inside_its_budgets(name, source):
    assert len(SHIPPED) >= 14
    program, reference = ScoreProgram(source), _as_trusted_python(source)
    for n, group, heads in ((1024, 7, 2), (4096, 3, 3)):  # Qwen's and SmolLM2's heads
        f = features(n, group, heads)
        out = program(f)
        assert torch.equal(out, reference(f))  # bitwise
        assert program.last_cost.peak_bytes <= 4 * 4 * ((2 * group + 3) * heads * n + n)  # far inside 16 x
    assert work_growth(program).exponent <= 1.1


def test_predicted_time_grows_linearly_and_rank_as_n_log_n():
    frc = work_growth(ScoreProgram(SEEDS["frc"]), n=1 << 16)
    assert frc.exponent == pytest.approx(1.0, abs=0.02)
    rank = work_growth(ScoreProgram(body("return rank(f.key_norm)")), n=1 << 16)
    assert rank.exponent == pytest.approx(math.log2(2 * math.log2(2 ** 17) / math.log2(2 ** 16)), abs=0.01)


def test_a_run_budget_stops_every_later_call_at_once():
    busy = ScoreProgram(body("return " + " + ".join(f"torch.tanh(f.key_norm * {i + 1})" for i in range(80))))
    f = features(20000)
    with run_budget(0.05):
        with pytest.raises(WallClockExceeded, match="the run's budget of 0.05 s for programs spent"):
            for _ in range(1000):
                busy(f)
        with pytest.raises(WallClockExceeded, match="the run's budget of 0.05 s for programs is spent"):
            ScoreProgram(body("return f.key_norm"))(f)
    assert tuple(ScoreProgram(body("return f.key_norm"))(f).shape) == (1, 2, 20000)  # outside the run
    assert issubclass(WallClockExceeded, LimitExceeded)


def test_an_operation_that_raises_or_misshapes_is_the_programs_error_with_its_line(monkeypatch):
    program = ScoreProgram(body("a = f.key_norm", "return torch.tanh(a) + a"), filename="p.py")

    def broken(x):
        raise RuntimeError("a torch kernel failed")

    monkeypatch.setitem(ops.FUNCTIONS, "torch.tanh", ops.FUNCTIONS["torch.tanh"].__class__(
        **{**ops.FUNCTIONS["torch.tanh"].__dict__, "run": broken}))
    with pytest.raises(ProgramFailed, match="p.py line 3: torch.tanh: RuntimeError: a torch kernel failed"):
        program(features(64))
    monkeypatch.setitem(ops.FUNCTIONS, "torch.tanh", ops.FUNCTIONS["torch.tanh"].__class__(
        **{**ops.FUNCTIONS["torch.tanh"].__dict__, "run": lambda x: x[..., :-1]}))
    with pytest.raises(ProgramFailed, match=r"p.py line 3: torch.tanh gave shape \(1, 2, 63\), the graph predicted "
                                            r"\(1, 2, 64\)"):
        program(features(64))
    assert issubclass(ProgramFailed, InterpreterError)


def test_number_arithmetic_at_run_time_fails_as_the_program():
    with pytest.raises(ProgramFailed, match="line 2: ZeroDivisionError: float division by zero"):
        ScoreProgram(body("return f.key_norm * (1 / f.layer)"))(synthetic_features(0, layer=0.0))


def test_the_sandbox_starts_from_a_symlinked_virtualenv_and_refuses_what_the_language_cannot_say(tmp_path):
    """The worker is started by the path of the Python running kvsieve: through a link to the virtualenv it used
    to fail at the full isolation level ("setpriv: failed to execute"), only the resolved path being mounted."""
    link = tmp_path / "venv"
    link.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)
    script = (
        "from kvsieve.evolve.sandbox import SandboxLimits, isolation_level, run_in_sandbox\n"
        "limits = SandboxLimits(timeout_s=30, memory_mb=2048)\n"
        "for source in ('def score(f):\\n    return group_mean(f.attn)\\n',\n"
        "               'def score(f):\\n    x = f.key_norm\\n    x += 1\\n    return x\\n'):\n"
        "    r = run_in_sandbox(source, window=8, limits=limits)\n"
        "    print(isolation_level(), r.status, r.invariants.get('linear_work'), '|', r.reason, '|', r.work_growth)\n")
    done = subprocess.run([str(link / "bin" / "python"), "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    linear, refused = done.stdout.strip().splitlines()
    assert linear.split()[1:3] == ["ok", "True"] and 0.9 < float(linear.split("grows as n^")[1][:4]) <= 1.05, linear
    assert refused.split()[1] == "rejected" and "line 3: augmented assignment" in refused, refused
