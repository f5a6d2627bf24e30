"""Predicted against measured time of every operation of the policy language, at 1k, 4k and 32k entries.

    python benchmarks/language_cost.py             # the table: predicted, measured (median of 5), ratio
    python benchmarks/language_cost.py --values    # each operation on each value class: measured / normal values
    python benchmarks/language_cost.py --fuzz 400  # random programs of the typed grammar: measured / predicted

Each operation runs on float32 inputs of (b 1, h 8, g 4, n) (a Llama-3-8B layer) with one torch thread. The
constants in ``kvsieve/language/cost.py`` (CALIBRATION) were read off this table: a prediction should err long,
within 3x of the measured time. The machine's load moves the measured column; say which machine and load.

Values move it too where the math library has slow paths: ``--values`` runs each operation, as the interpreter runs
it (through ``operations.GUARDED_RANGES``) and as bare torch, on inputs of one value class (normal, subnormal, zero,
negative, inf, NaN, 1e30, or a mixture of all), and prints measured / the same operation on normal values. The fuzz
draws each program's number literals and its features from those classes (literals a class cannot write, such as a
subnormal or 1e30, are refused by stage 0 and counted) and prints the worst measured / predicted ratio.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import subprocess
import time
from dataclasses import replace

import torch

from kvsieve.language import grammar
from kvsieve.language import operations as ops
from kvsieve.language.interpreter import InterpreterError, Limits, ScoreProgram
from kvsieve.language.program_features import TENSOR_FIELDS, Features, synthetic_features
from kvsieve.language.static_check import StaticCheckError, check_source

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
    "neg": "-f.key_norm", "** 2": "f.key_norm ** 2", "** 4": "f.key_norm ** 4",
}

# the value classes: a fill value for inputs (None: the synthetic features' own, normal values) and the text of a
# number literal of the class (None: none can be written; 1e-40 and 1e30 are refused by stage 0)
VALUE_CLASSES: dict[str, tuple[float | None, str | None]] = {
    "normal": (None, None), "subnormal": (1e-40, "1e-40"), "zero": (0.0, "0.0"), "negative": (-3.0, "-3.0"),
    "inf": (math.inf, "1e999"), "NaN": (math.nan, None), "1e30": (1e30, "1e30"), "mixed": (None, None),
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


def _filled(features: Features, value_class: str, rng: random.Random) -> Features:
    """``features`` with every tensor made of ``value_class`` (its fill value; "mixed": each element of a random
    class; "normal": unchanged)."""
    fill, _ = VALUE_CLASSES[value_class]
    if value_class == "normal":
        return features
    tensors = {}
    for name in TENSOR_FIELDS:
        tensor = getattr(features, name)
        if value_class == "mixed":
            values = torch.tensor([v if v is not None else 1.0 for v, _ in VALUE_CLASSES.values()])
            gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
            picks = torch.randint(len(values), tensor.shape, generator=gen)
            tensors[name] = torch.where(picks == 0, tensor, values[picks])
        else:
            tensors[name] = torch.full_like(tensor, fill)
    return replace(features, **tensors)


def values_table(n: int = 4096) -> None:
    """Each unary operation and power on each value class: measured / the same on normal values, through the
    interpreter (the guards of GUARDED_RANGES) and as bare torch."""
    base = synthetic_features(0, batch=1, kv_heads=8, group=4, n=n, window=64)
    rng = random.Random(0)
    inputs = {name: _filled(base, name, rng).key_norm for name in VALUE_CLASSES}
    names = [name for name in ops.FUNCTIONS if name.startswith("torch.") and ops.FUNCTIONS[name].tensors == 1
             and not ops.FUNCTIONS[name].literals]
    print(f"# each operation on (1, 8, {n}) inputs of one value class: median time / its time on normal values, "
          "as the language runs it (bare torch in brackets)")
    print(f"{'operation':<16}" + "".join(f"{c:>14}" for c in VALUE_CLASSES if c != "normal"))
    worst = 0.0
    for name in [*names, "** 4", "** -3", "** 2"]:
        if name.startswith("**"):
            k = int(name.split()[1])
            runs = (lambda x, k=k: x ** k, lambda x, k=k: x ** k)
        else:
            runs = (ops.FUNCTIONS[name].run, getattr(torch, name.split(".")[1]))
        cells = []
        for fn in runs:
            normal = _time(fn, inputs["normal"])
            cells.append({c: _time(fn, x) / normal for c, x in inputs.items() if c != "normal"})
        worst = max(worst, *cells[0].values())
        print(f"{name:<16}" + "".join(f"{f'{cells[0][c]:.1f} ({cells[1][c]:.1f})':>14}" for c in cells[0]))
    print(f"worst slowdown through the language: {worst:.1f}x")


def _time(fn, x: torch.Tensor, repeats: int = 7) -> float:
    fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _literal(value_class: str):
    """A NUMBER drawer for ``grammar.sample``: the class's literal half of the time, the grammar's otherwise."""
    text = VALUE_CLASSES[value_class][1]

    def draw(rng: random.Random) -> str:
        if text is None or rng.random() < 0.5:
            return grammar.number_text(rng)
        return text
    return draw


def fuzz(count: int) -> None:
    """Random typed programs at 4k, their literals and features drawn from the value classes: every failure an
    InterpreterError; measured time against 3 x predicted + 1 ms; the worst measured / predicted."""
    base = synthetic_features(0, batch=1, kv_heads=8, group=4, n=4096, window=64)
    classes = list(VALUE_CLASSES)
    ratios, over, other, refused, failed = [], [], 0, 0, 0
    worst = (0.0, "", "", "")
    for seed in range(count):
        rng = random.Random(seed)
        literals, inputs = classes[seed % len(classes)], rng.choice(classes)
        source = grammar.sample(seed, numbers=_literal(literals))
        try:
            check_source(source)
        except StaticCheckError:
            refused += 1
            continue
        program = ScoreProgram(source, limits=Limits(deadline_s=None))
        features = _filled(base, inputs, rng)
        predicted = program.predict(1, 8, 4, 4096).total_ns
        try:
            measured = _measure(program, features, repeats=3)
        except InterpreterError:
            failed += 1
            continue
        except Exception:  # noqa: BLE001 - counted: the language promises none
            other += 1
            continue
        ratios.append(measured / predicted)
        if measured / predicted > worst[0]:
            worst = (measured / predicted, literals, inputs, source.split("return ")[-1].strip())
        if measured > 3 * predicted + 1e6:
            over.append((round(measured / predicted, 1), literals, inputs))
    ratios.sort()
    print(f"{count} programs at n=4096 (literals and features from {', '.join(classes)}): {refused} refused by "
          f"stage 0, {failed} failed as InterpreterError, {other} other failures; measured / predicted median "
          f"{ratios[len(ratios) // 2]:.2f}, worst {ratios[-1]:.2f} (literals {worst[1]}, features {worst[2]}: "
          f"{worst[3][:100]}); over 3 x predicted + 1 ms: {len(over)} {over[:5]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz", type=int, default=0, help="also time this many random programs")
    parser.add_argument("--values", action="store_true", help="also time each operation on each value class")
    parser.add_argument("--no-table", action="store_true", help="skip the per-operation table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread, float32, revision {revision}")
    print("# dims b=1 h=8 g=4; n as in each column")
    if not args.no_table:
        table()
    if args.values:
        values_table()
    if args.fuzz:
        fuzz(args.fuzz)


if __name__ == "__main__":
    main()
