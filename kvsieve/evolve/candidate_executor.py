"""Where candidates are evaluated: one interface, so a distributed engine can take the local one's place.

An executor owns the model and the dev set (prefilled once) and evaluates batches of programs; the
loop and the program database stay with the caller. The local executor evaluates one program after
the other in this process (each program's code still runs in its own sandbox process).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from kvsieve.evolve.cascade import DevSet, Evaluation, KnownKept, evaluate_program
from kvsieve.evolve.sandbox import SandboxLimits
from kvsieve.language.program_source import Program

__all__ = ["Executor", "LocalExecutor"]


class Executor(Protocol):
    def evaluate(self, programs: list[Program], max_gap: float | None = None,
                 on_result: Callable[[int, Evaluation], None] | None = None,
                 known: Mapping[str, KnownKept] | None = None) -> list[Evaluation]:
        """Evaluations in the order of ``programs``; ``on_result(i, evaluation)`` as each finishes; ``known``:
        earlier programs' results by the entries they keep (``evaluate_program``)."""
        ...

    def close(self) -> None: ...


class LocalExecutor:
    def __init__(self, dev: DevSet, limits: SandboxLimits | None = None, fitness: str = "task",
                 alternate: bool = False) -> None:
        self.dev = dev
        self.limits = limits or SandboxLimits()
        self.fitness, self.alternate = fitness, alternate  # how a candidate is scored (evaluate_program)

    def evaluate(self, programs: list[Program], max_gap: float | None = None,
                 on_result: Callable[[int, Evaluation], None] | None = None,
                 known: Mapping[str, KnownKept] | None = None) -> list[Evaluation]:
        out = []
        for i, program in enumerate(programs):
            evaluation = evaluate_program(program, self.dev, self.limits, max_gap, known, self.fitness,
                                          self.alternate)
            if on_result is not None:
                on_result(i, evaluation)
            out.append(evaluation)
        return out

    def close(self) -> None:
        pass
