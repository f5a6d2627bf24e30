"""A test-sized fuzz of the language (the large one, with timings: ``benchmarks/language_cost.py --fuzz N``).

Random edits of valid programs (tokens inserted, deleted, swapped) must either parse or be refused with a
``ProgramRefused``; what parses must run, or fail with an ``InterpreterError`` from its own number arithmetic
(a division by zero), never a torch error or another exception, and must hold to its predicted shapes."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import torch

from kvsieve.evolve.seeds import SEEDS
from kvsieve.language import grammar
from kvsieve.language import operations as ops
from kvsieve.language.interpreter import InterpreterError, LimitExceeded, ScoreProgram
from kvsieve.language.program_features import synthetic_features
from kvsieve.language.typed_graph import ProgramRefused, build_graph

torch.set_num_threads(1)

PIECES = ["(", ")", " + ", " - ", " * ", " / ", " ** ", "**2", "-", "[0]", "f.", "f.attn", "f.key_norm", "f.n",
          "torch.", "torch.exp(", "pool(", "rank(", "round(", "range(", ", ", ", 9", "257", "1e9", "10 ** 10",
          "\n    x = ", "\n    return ", " if ", " for ", "x", ".mean()", "+=", "lambda", "[", "]", '"', "0.0",
          "group_mean(", "unit_mean(", "\n", "    ", "#", "torch.clamp(", "max_pool(", ".",
          # one edit from mixing shape families: (b, h, g, n) with (b, h, n), (n) with either
          " + f.attn", " * f.last_attn", " + f.key_norm", " - f.surrogate", " * f.position", "group_mean(f.attn + "]


def _mutate(source: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(source) + 1)
        choice = rng.random()
        if choice < 0.5:
            source = source[:at] + rng.choice(PIECES) + source[at:]
        elif choice < 0.8:
            source = source[:at] + source[at + rng.randint(1, 6):]
        else:
            other = rng.randrange(len(source) + 1)
            a, b = sorted((at, other))
            source = source[:a] + source[b:b + 8] + source[a:b] + source[b + 8:]
    return source


def test_random_edits_are_refused_or_run_and_fail_only_as_the_program():
    rng = random.Random(0)
    bases = [*SEEDS.values(), *(grammar.sample(seed, max_depth=4) for seed in range(20))]
    features = synthetic_features(1, batch=1, kv_heads=2, group=3, n=80, window=8)
    parsed = ran = 0
    for _ in range(6000):
        source = _mutate(rng.choice(bases), rng)
        try:
            graph = build_graph(source, "fuzz.py")
        except ProgramRefused as err:
            assert "fuzz.py" in str(err) and len(str(err)) < 1200, str(err)
            continue
        parsed += 1
        program = ScoreProgram(source, filename="fuzz.py")
        try:
            out = program(features)
        except LimitExceeded:
            continue
        except InterpreterError as err:  # what the checker accepted fails only by its numbers' arithmetic
            assert str(err).startswith("fuzz.py"), str(err)
            assert "ZeroDivisionError" in str(err) or "not a finite number" in str(err), str(err)
            continue
        ran += 1
        assert tuple(out.shape) == (1, 2, 80) and out.dtype == torch.float32
        assert graph.nodes[graph.output].shape == ("b", "h", "n")
    assert parsed > 200 and ran > 150  # the fuzz reaches the interpreter, not only the parser


# the value classes of issue 72 (benchmarks/language_cost.py --fuzz times them; here only what may be raised)
VALUES = {"subnormal": 1e-40, "zero": 0.0, "negative": -3.0, "inf": math.inf, "-inf": -math.inf, "NaN": math.nan,
          "1e30": 1e30}


def test_typed_programs_on_every_value_class_run_or_fail_only_as_the_program():
    """Random programs of the typed grammar on features made of one value class (or all of them mixed): each runs to
    scores of the right shape or fails with an InterpreterError; the guarded operations never return NaN from a
    value that is not NaN."""
    base = synthetic_features(2, batch=1, kv_heads=2, group=3, n=64, window=8)
    gen = torch.Generator().manual_seed(0)
    classes = [*VALUES, "mixed"]
    ran = 0
    for seed in range(120):
        fill = classes[seed % len(classes)]
        tensors = {}
        for name, tensor in base.tensors().items():
            if fill == "mixed":
                values = torch.tensor(list(VALUES.values()))
                tensors[name] = values[torch.randint(len(values), tensor.shape, generator=gen)]
            else:
                tensors[name] = torch.full_like(tensor, VALUES[fill])
        features = replace(base, **tensors)
        try:
            out = ScoreProgram(grammar.sample(seed), filename="fuzz.py")(features)
        except InterpreterError as err:
            assert str(err).startswith("fuzz.py"), str(err)
            continue
        ran += 1
        assert tuple(out.shape) == (1, 2, 64) and out.dtype == torch.float32
    assert ran > 100
    for name in ops.GUARDED_RANGES:
        read = ops.FUNCTIONS[f"torch.{name}"].run(torch.tensor([*VALUES.values()]))
        assert bool(torch.isfinite(read).all()), (name, read)
