"""A policy read from a program file: what ``kvsieve evolve`` exports (``--policies program:best.py``).

The file is an evolved program (``kvsieve/evolve/program.py`` format): it passes the same static
check as a candidate's stage 0 before it is compiled, and it runs in-process against the compact
interface (:class:`kvsieve.evolve.features.Features`), which exposes tensors and pure tensor maths
only. Run files you did not check yourself through ``kvsieve evolve``'s sandbox instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvsieve.policies.base import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


class ProgramPolicy(Policy):
    name = "program"

    def __init__(self, path: str | None = None, source: str | None = None, **kwargs) -> None:
        from kvsieve.evolve.features import compile_score
        from kvsieve.evolve.program import Program
        from kvsieve.evolve.static import check_source

        if (path is None) == (source is None):
            raise ValueError("give exactly one of path= (a program file) or source=")
        if path is not None:
            if not Path(path).is_file():
                raise ValueError(f"program file {path!r} does not exist")
            source = Path(path).read_text(encoding="utf-8")
        check_source(source)
        self.path = path
        self.program = Program(source)
        self._score = compile_score(source, filename=path or "<program>")
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return self.program.selection(self.window)

    def score(self, signals: Signals) -> torch.Tensor:
        from kvsieve.evolve.features import Features

        scores = self._score(Features.from_signals(signals))
        expected = (signals.batch_size, signals.num_kv_heads, signals.seq_len)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
            raise ValueError(f"program {self.path or '<source>'} returned {getattr(scores, 'shape', type(scores))},"
                             f" expected scores shaped {expected}")
        return scores.float()

    def __repr__(self) -> str:
        return f"ProgramPolicy(path={self.path!r}, window={self.window}, selection={self.selection})"
