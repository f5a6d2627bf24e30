"""Test only (the candidate deadline's tests): a trusted loader the sandbox worker uses in place of the interpreter
when ``layers={"raw_loader": PATH}``. It interprets the program of the language exactly as kvsieve does, but every
call takes half a second longer: what an operation on a slow path its price does not know would cost. The parent
prices the program as usual (its text is in the language), so the run has a deadline of its own."""

from __future__ import annotations

import time

from kvsieve.language.interpreter import Limits, ScoreProgram

EXTRA_S = 0.5


def load(source: str):
    program = ScoreProgram(source, limits=Limits(deadline_s=None), filename="program")

    def score(features):
        time.sleep(EXTRA_S)
        return program(features)

    return score
