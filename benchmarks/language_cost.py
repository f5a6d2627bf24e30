"""Predicted against measured time of every operation of the policy language, at 1k, 4k and 32k entries.

    python benchmarks/language_cost.py             # the table: predicted, measured (median of 5), ratio
    python benchmarks/language_cost.py --fuzz 400  # random programs of the typed grammar: measured / predicted

Each operation runs on float32 inputs of (b 1, h 8, g 4, n) (a Llama-3-8B layer) with one torch thread. The
constants in ``kvsieve/language/cost.py`` (CALIBRATION) were read off this table: a prediction should err long,
within 3x of the measured time. The machine's load moves the measured column; say which machine and load.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import torch

from kvsieve.language import grammar
from kvsieve.language import operations as ops
from kvsieve.language.interpreter import InterpreterError, Limits, ScoreProgram
from kvsieve.language.program_features import synthetic_features

LENGTHS = (1024, 4096, 32768)


def _program(expression: str) -> str:
    return f"def score(f):\n    return {expression}\n"


# one expression per operation, each with its one costly node on a (b, h, n) or (b, h, g, n) input
CASES = {
    **{name: f"{name}(f.key_norm)" for name in ("normalize", "unit_mean", "rank")},
    "pool k=9": "pool(f.key_norm, 9)", "pool k=257": "pool(f.key_norm, 257)",
    "max_pool k=9": "max_pool(f.key_norm, 9)", "max_pool k=257": "max_pool(f.key_norm, 257)",
    "group_mean": "group_mean(f.attn)", "group_max": "group_max(f.attn)",
    **{name: f"{name}(f.key_norm)" for name in ops.FUNCTIONS if name.startswith("torch.")
       and ops.FUNCTIONS[name].tensors == 1 and not ops.FUNCTIONS[name].literals},
    "torch.clamp": "torch.clamp(f.key_norm, 0.5, 2.0)", "torch.maximum": "torch.maximum(f.key_norm, f.value_norm)",
    "+": "f.key_norm + f.value_norm", "*": "f.key_norm * f.value_norm", "/": "f.key_norm / f.value_norm",
    "neg": "-f.key_norm", "** 2": "f.key_norm ** 2",
}


def _measure(program: ScoreProgram, features, repeats: int = 5) -> float:
    program(features)  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        program(features)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e9


def table() -> float:
    worst = 0.0
    print(f"{'operation':<16}" + "".join(f"{f'n={n}: pred / meas us (x)':>34}" for n in LENGTHS))
    feats = {n: synthetic_features(0, batch=1, kv_heads=8, group=4, n=n, window=64) for n in LENGTHS}
    for name, expression in CASES.items():
        program = ScoreProgram(_program(expression), limits=Limits(deadline_s=None))
        cells = []
        for n in LENGTHS:
            predicted = program.predict(1, 8, 4, n).total_ns
            measured = _measure(program, feats[n])
            ratio = predicted / measured
            worst = max(worst, ratio, 1 / ratio)
            cells.append(f"{predicted / 1e3:>12.0f} / {measured / 1e3:>9.0f} ({ratio:4.1f}x)")
        print(f"{name:<16}" + "".join(f"{c:>34}" for c in cells))
    print(f"worst ratio either way: {worst:.1f}x")
    return worst


def fuzz(count: int) -> None:
    """Random typed programs at 4k: every failure an InterpreterError; measured time against 3 x predicted."""
    features = synthetic_features(0, batch=1, kv_heads=8, group=4, n=4096, window=64)
    ratios, over, other = [], 0, 0
    for seed in range(count):
        program = ScoreProgram(grammar.sample(seed, max_depth=5), limits=Limits(deadline_s=None))
        predicted = program.predict(1, 8, 4, 4096).total_ns
        try:
            measured = _measure(program, features, repeats=3)
        except InterpreterError:
            continue
        except Exception:  # noqa: BLE001 - counted: the language promises none
            other += 1
            continue
        ratios.append(measured / predicted)
        over += measured > 3 * predicted + 1e6
    ratios.sort()
    print(f"{count} programs at n=4096: measured / predicted median {ratios[len(ratios) // 2]:.2f}, "
          f"max {ratios[-1]:.2f}; over 3 x predicted + 1 ms: {over}; non-InterpreterError failures: {other}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz", type=int, default=0, help="also time this many random programs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread, float32, revision {revision}")
    print("# dims b=1 h=8 g=4; n as in each column")
    table()
    if args.fuzz:
        fuzz(args.fuzz)


if __name__ == "__main__":
    main()
