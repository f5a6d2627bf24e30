"""Issue 48's reproducers, each a program file, in every caller that runs programs: ``kvsieve eval`` (the grid's
spec is parsed when the config is made: the file and line are named before any work, as for an unknown policy),
the policy registry ``kvsieve serve`` builds its points with (refused at start-up, before any request) and the
sandbox (refused by stage 0 in the parent, and by the worker's parser when stage 0 is skipped). An expressible
program over its budget fails its own cell while the others complete (tests/harness/test_failed_cells.py)."""

from __future__ import annotations

import time

import pytest
import torch

from kvsieve.evolve.sandbox import SandboxLimits, run_in_sandbox
from kvsieve.harness.grid import GridConfig
from kvsieve.policies.registry import from_spec

torch.set_num_threads(1)


def body(*lines: str) -> str:
    return "def score(f):\n" + "".join(f"    {line}\n" for line in lines)


# name -> (source, the line refused, what the refusal says)
REPRODUCERS = {
    "round": (body("k = 10 ** 9", "return group_mean(f.attn) * round(7, -k)"), 2, "the exponent of ** must be"),
    "round_late": (body("x = group_mean(f.attn)", "return x * round(7, -3)"), 3, "'round' is not an operation"),
    "augassign": (body("x = group_mean(f.attn)", "x += f.key_norm", "return x"), 3, "augmented assignment"),
    "mask": (body("x = f.attn[f.attn > 0]", "return group_mean(f.attn)"), 2, "indexing"),
    "where": (body("return torch.where(f.key_norm)"), 2, "'torch.where' is not an operation"),
    "stack": (body("return torch.stack([f.key_norm] * 4096).mean(0)"), 2, "is not an operation"),
    "power_tower": (body("return group_mean(f.attn) * 10 ** 10 ** 6"), 2, "the exponent of ** must be"),
    # issue 72: stage 0 raised something other than a refusal on each (a traceback in eval, a raise in the sandbox);
    # the hex SELECTION value and key, and the rest, in tests/language/test_values.py
    "wide_literal": (body("x = group_mean(f.attn)", "return x * " + "9" * 401), 3, "an integer of 1333 bits"),
    "hex_exponent": (body("return group_mean(f.attn) ** 0x" + "f" * 4000), 2, "an integer of 16000 bits"),
    "unhashable_selection": ("SELECTION = {[]: 1}\n" + body("return group_mean(f.attn)"), 1,
                             "SELECTION must be a literal dict"),
}


@pytest.fixture
def programs(tmp_path):
    paths = {}
    for name, (source, _, _) in REPRODUCERS.items():
        paths[name] = tmp_path / f"{name}.py"
        paths[name].write_text(source)
    return paths


def test_in_eval_each_reproducer_is_refused_with_its_line_when_the_grid_is_made(programs):
    for name, (_, line, says) in REPRODUCERS.items():
        start = time.perf_counter()
        with pytest.raises(ValueError, match=rf"{name}.py line {line}: ") as err:
            GridConfig(model="tiny", tasks=["niah_single_1"], lengths=[480], samples=1, ratios=[0.5],
                       policies=["full", "snapkv", f"program:{programs[name]}"])
        assert says in str(err.value) and "Traceback" not in str(err.value)
        assert time.perf_counter() - start < 5


def test_in_serve_the_point_is_refused_when_it_is_built(programs):
    for name, (_, line, says) in REPRODUCERS.items():
        start = time.perf_counter()
        with pytest.raises(ValueError, match=rf"{name}.py line {line}: .*{says[:12]}") as err:
            from_spec(f"program:{programs[name]}")
        assert time.perf_counter() - start < 5, err.value


@pytest.mark.parametrize("static_check", [True, False])
def test_in_the_sandbox_each_reproducer_is_refused_by_the_language(static_check):
    for name, (source, line, says) in REPRODUCERS.items():
        result = run_in_sandbox(source, window=8, limits=SandboxLimits(timeout_s=30, memory_mb=2048),
                                static_check=static_check)
        assert result.status == ("rejected" if static_check else "invalid"), (name, result.status, result.reason)
        assert f"line {line}: " in result.reason and says in result.reason, (name, result.reason)
