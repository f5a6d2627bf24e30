"""The interpreter's cost model (issue 41): every operation is costed from its inputs' shapes before it runs.

Each hostile program below passes stage 0 and is cheap at short contexts; the expected sizes are worked out here
from the shapes alone (not read from the interpreter), and each refusal must come before the cost is paid: the
calls return within a second where paying would take tens of seconds or gigabytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvsieve.evolve.seeds import SEEDS
from kvsieve.language.interpreter import (
    MAX_WORK_EXPONENT,
    InterpreterError,
    LimitExceeded,
    Limits,
    ScoreProgram,
    run_budget,
    work_growth,
)
from kvsieve.language.program_features import synthetic_features
from kvsieve.language.static_check import check_source

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "results" / "evolve").glob("*.py"))
LIMITS = Limits()


def body(*lines: str) -> str:
    return "def score(f):\n" + "".join(f"    {line}\n" for line in lines)


def qwen_like(n: int, group: int = 7, kv_heads: int = 2):
    """Features shaped as Qwen2.5-0.5B's (2 KV heads, 7 query heads each)."""
    return synthetic_features(0, batch=1, kv_heads=kv_heads, group=group, n=n, window=64)


def inputs(n: int, group: int = 7, kv_heads: int = 2) -> int:
    """Elements a call receives: attn and last_attn (h g n each), key_norm, value_norm, surrogate (h n), position."""
    return 2 * kv_heads * group * n + 3 * kv_heads * n + n


def refused(source: str, features, match: str) -> tuple[str, float, ScoreProgram]:
    check_source(source)  # each case passes stage 0: the interpreter alone must stop it
    program = ScoreProgram(source)
    start = time.perf_counter()
    with pytest.raises(LimitExceeded) as err:
        program(features)
    seconds = time.perf_counter() - start
    assert match in str(err.value), str(err.value)
    return str(err.value), seconds, program


def test_the_pool_sleeper_is_refused_before_its_n_by_n_product_at_every_length():
    # 70 calls of pool(x, 257) on the n x n product of the group-mean attention, once f.n > 600
    sleeper = body("a = group_mean(f.attn)", "if f.n > 600:", "    m = a.unsqueeze(-1) * a.unsqueeze(-2)",
                   "    for i in range(70):", "        m = pool(m, 257)", "    a = a + 0.0 * m.mean(dim=-1)",
                   "return a")
    short = ScoreProgram(sleeper)(qwen_like(512))
    assert tuple(short.shape) == (1, 2, 512)
    for n in (1024, 4096, 32768):
        product = 2 * n * n  # (b, h, n, n)
        text, seconds, _ = refused(sleeper, qwen_like(n), f"limit: a tensor of {product} elements")
        assert "line 4" in text and seconds < 1.0  # paying would take ~40 s per call at n 1024


def test_pooling_the_same_linear_signal_seventy_times_runs_out_of_work_not_time():
    source = body("a = group_mean(f.attn)", "for i in range(70):", "    a = pool(a, 257)", "return a")
    n = 4096
    per_pool = 257 * 2 * n  # a window of 257 over each of the b h n entries
    budget = LIMITS.work_per_input * inputs(n)
    text, seconds, program = refused(source, qwen_like(n), "elements of tensor work")
    assert f"more than {budget} elements" in text and seconds < 2.0
    # the refused pool is the first whose work would pass the budget (group_mean's 2 * 7 * n came first)
    assert program.last_cost.work > budget >= program.last_cost.work - per_pool


def test_index_tensors_shaped_m_1_and_1_m_are_refused_before_allocating_m_squared():
    # integer index tensors of shapes (M, 1) and (1, M) broadcast to an (M, M) result
    source = body("i = f.attn.max(dim=2).indices.reshape(-1)", "r = i.reshape(-1, 1)", "c = i.reshape(1, -1)",
                  "x = f.attn[0, 0][r, c]", "return f.key_norm + 0.0 * x.mean()")
    n = 4096
    m = 2 * n  # b h n indices
    text, seconds, _ = refused(source, qwen_like(n), f"limit: a tensor of {m * m} elements")
    assert "line 5" in text and seconds < 1.0  # 64 M elements, 256 MiB, never allocated
    # the same indexing at a size the budget holds is exact
    small = synthetic_features(0, batch=1, kv_heads=1, group=3, n=8, window=4)
    out = ScoreProgram(body("i = f.attn.max(dim=2).indices.reshape(-1)", "x = f.attn[0, 0][i.reshape(-1, 1), "
                            "i.reshape(1, -1)]", "return f.key_norm + x.sum()"))(small)
    i = small.attn.max(dim=2).indices.reshape(-1)
    assert torch.equal(out, small.key_norm + small.attn[0, 0][i.reshape(-1, 1), i.reshape(1, -1)].sum())


def test_roll_with_one_dim_repeated_256_times_is_refused_before_its_copies():
    n = 4096
    shifts, dims = "(" + "1, " * 256 + ")", "(" + "3, " * 256 + ")"
    attn = 2 * 7 * n
    memory = LIMITS.memory_per_input * inputs(n)
    for call in (f"torch.roll(f.attn, {shifts}, {dims})", f"f.attn.roll({shifts}, {dims})"):
        source = body(f"x = {call}", "return group_mean(x)")
        text, seconds, _ = refused(source, qwen_like(n), "elements live at once")
        assert f"{257 * attn} elements" in text and f"limit {memory}" in text and seconds < 1.0
    ok = ScoreProgram(body("return group_mean(torch.roll(f.attn, 1, 3))"))(qwen_like(n))
    assert torch.equal(ok, torch.roll(qwen_like(n).attn, 1, 3).mean(dim=2))


def test_boolean_mask_copies_hoarded_in_a_tuple_are_charged_and_refused():
    n = 4096
    hoard = body("m = f.attn > 0.0", "t = ()", "for i in range(200):", "    t = t + (f.attn[m],)",
                 "return f.key_norm + 0.0 * len(t)")
    attn, memory = 2 * 7 * n, LIMITS.memory_per_input * inputs(n)
    text, seconds, program = refused(hoard, qwen_like(n), "elements live at once")
    assert seconds < 1.0 and program.last_cost.peak <= memory  # what it held never passed the budget
    held_copies = (program.last_cost.peak - attn // 4) // attn  # the bool mask is a quarter of a float copy
    assert held_copies == (memory - attn // 4) // attn  # refused at the first copy that would not fit
    # the same copies dropped at each step are freed as they go: that program runs
    dropped = body("m = f.attn > 0.0", "x = f.key_norm", "for i in range(200):", "    y = f.attn[m]",
                   "return x + 0.0 * y.sum()")
    assert tuple(ScoreProgram(dropped)(qwen_like(n)).shape) == (1, 2, n)


@pytest.mark.parametrize("call", ["normalize(3)", "unit_mean(3)", "group_mean(3)", "group_max(3)", "max_pool(3, 5)",
                                  "pool(3, 5)", "rank(3)", "group_mean(f.position)", "pool(f.key_norm, 1000)",
                                  "max_pool(f.key_norm, 2.5)"])
def test_helpers_given_what_they_cannot_take_raise_an_interpreter_error_naming_the_line(call):
    source = body("x = f.key_norm", f"y = {call}", "return x")
    check_source(source)
    with pytest.raises(InterpreterError, match="line 3") as err:
        ScoreProgram(source)(qwen_like(64))
    assert not isinstance(err.value, LimitExceeded)


def _shipped() -> list[tuple[str, str]]:
    return [(p.name, p.read_text()) for p in SHIPPED] + [("seed frc", SEEDS["frc"])]


@pytest.mark.parametrize("name,source", _shipped(), ids=[name for name, _ in _shipped()])
def test_every_shipped_program_and_frc_runs_at_1k_and_4k_well_inside_its_budgets(name, source):
    assert len(SHIPPED) >= 14  # the exported programs of results/evolve
    program = ScoreProgram(source)
    for n, group, heads in ((1024, 7, 2), (4096, 7, 2), (1024, 3, 3), (4096, 3, 3)):  # Qwen's and SmolLM2's heads
        out = program(qwen_like(n, group, heads))
        assert tuple(out.shape) == (1, heads, n) and bool(torch.isfinite(out).all())
        cost, received = program.last_cost, inputs(n, group, heads)
        assert cost.work <= 8 * received and cost.peak <= 2 * received  # far inside 256 x and 16 x
    assert work_growth(program, 64).exponent <= 1.1


def test_a_linear_program_runs_at_any_length_and_its_work_grows_linearly():
    frc = ScoreProgram(SEEDS["frc"])
    out = frc(qwen_like(32768, group=4, kv_heads=8))
    assert tuple(out.shape) == (1, 8, 32768)
    growth = work_growth(frc, 64)
    assert growth.n == (293, 586) and growth.work[1] == 2 * growth.work[0] and growth.exponent == pytest.approx(1.0)


@pytest.mark.parametrize("source,exponent", [
    (body("return pool(group_mean(f.attn), min(f.n // 4, 257))"), 1.9),  # a kernel that grows with the context
    (body("a = group_mean(f.attn)", "return (a.unsqueeze(-1) * a.unsqueeze(-2)).mean(dim=-1)"), None),
])
def test_superlinear_work_is_measured_above_the_stage_1_bound(source, exponent):
    program = ScoreProgram(source)
    if exponent is None:  # an n x n intermediate never reaches the measure: refused at the first length
        with pytest.raises(LimitExceeded, match="limit: a tensor of"):
            work_growth(program, 64)
        return
    growth = work_growth(program, 64)
    assert growth.exponent > MAX_WORK_EXPONENT and growth.exponent == pytest.approx(exponent, abs=0.1)
    rank = work_growth(ScoreProgram(body("return rank(group_mean(f.attn))")), 64)
    assert 1.0 < rank.exponent < MAX_WORK_EXPONENT  # n log n passes


def test_a_run_budget_stops_every_later_call_at_once():
    # each call well inside its own budgets (300 softmax passes of 40 000 elements), ~30 ms
    busy = ScoreProgram(body("x = f.key_norm", "for i in range(300):", "    x = torch.softmax(x, dim=-1)",
                             "return x"))
    features = qwen_like(20000)
    start = time.perf_counter()
    with run_budget(0.2):
        with pytest.raises(LimitExceeded, match="the run's budget of 0.2 s for programs spent"):
            for _ in range(100):
                busy(features)
        with pytest.raises(LimitExceeded, match="the run's budget of 0.2 s for programs is spent"):
            ScoreProgram(body("return f.key_norm"))(features)
    assert time.perf_counter() - start < 3.0
    assert tuple(ScoreProgram(body("return f.key_norm"))(features).shape) == (1, 2, 20000)  # outside the run


def test_the_sandbox_starts_from_a_symlinked_virtualenv_and_stage_1_refuses_superlinear_work(tmp_path):
    """The worker is started by the path of the Python running kvsieve: through a link to the virtualenv it used
    to fail at the full isolation level ("setpriv: failed to execute"), only the resolved path being mounted."""
    link = tmp_path / "venv"
    link.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)
    script = (
        "from kvsieve.evolve.sandbox import SandboxLimits, isolation_level, run_in_sandbox\n"
        "limits = SandboxLimits(timeout_s=30, memory_mb=2048)\n"
        "for source in ('def score(f):\\n    return group_mean(f.attn)\\n',\n"
        "               'def score(f):\\n    return pool(group_mean(f.attn), min(f.n // 4, 257))\\n'):\n"
        "    r = run_in_sandbox(source, window=8, limits=limits)\n"
        "    print(isolation_level(), r.status, r.invariants.get('linear_work'), '|', r.reason, '|', r.work_growth)\n")
    done = subprocess.run([str(link / "bin" / "python"), "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    linear, superlinear = done.stdout.strip().splitlines()
    assert linear.split()[1:3] == ["ok", "True"] and "grows as n^1.00" in linear, linear
    assert superlinear.split()[1:3] == ["invalid", "False"], superlinear
    assert "its work grows faster than the context" in superlinear and "at most n^1.3" in superlinear
