"""The evolved programs kvsieve ships by name, and the one way to turn a program argument into a file.

``program:NAME`` (or ``program(path=NAME, ...)``) runs the named program; any other value is a program file's path.
Each named file is, byte for byte, the file ``kvsieve pick`` wrote under ``results/evolve/`` when its selection rule
picked it (``origin``): its first line says which rule, database and program. A file with a named program's bytes is
that program wherever it lies (:func:`program_name`), so the results store keys its rows by the name, not the path
(``kvsieve.policies.registry.parse``): moving or copying the file changes no key. The table is docs/policies.md's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = ["PROGRAM_DIR", "PROGRAMS", "NamedProgram", "program_file", "program_name"]

PROGRAM_DIR = Path(__file__).parent / "programs"


@dataclass(frozen=True)
class NamedProgram:
    """One shipped program: its file in PROGRAM_DIR and how it was chosen."""

    name: str
    file: str  # in PROGRAM_DIR
    model: str  # the model its rule scored it on
    rule: str  # the selection rule file ``kvsieve pick --config`` applied (repository path)
    picked: str  # what the rule printed: the program's number in its database
    known_as: str  # the number the results pages call it by
    commit: str  # the commit that added the file ``kvsieve pick`` wrote
    origin: str  # that file (repository path)
    surrogate: str | None = None  # the kvzap checkpoint it was scored over, when not the model's shipped one
    about: str = ""


_QWEN = "qwen2.5-coder-0.5b-instruct"
_QWEN_PICKED = f"{_QWEN}-picked.py"
_PROGRAMS = (
    NamedProgram("smollm2-pick", "smollm2-pick.py", "smollm2-135m-instruct", "configs/selection.toml",
                 "#32 of results/evolve/smollm2-surrogate.sqlite", "#32", "6dac3e6120865012a67e70db5b85019def84eb86",
                 "results/evolve/picked/smollm2-135m-instruct-picked.py",
                 about="the SmolLM2 headline's pick"),
    NamedProgram("qwen-pick-floor-high", "qwen-pick-floor-high.py", _QWEN, "configs/selection-floor-high-qwen-4k.toml",
                 "#3 of results/evolve/floor-qwen-4k/floor-high.sqlite", "#38 at floor 40",
                 "f6a6c5bc82302f69bb246e31b158ec211c7f1ece", f"results/evolve/picked-floor-high-qwen-4k/{_QWEN_PICKED}",
                 about="the Qwen headline's pick; the 2k study's #38 seeded at floor 40"),
    NamedProgram("qwen-pick-floor", "qwen-pick-floor.py", _QWEN,
                 "experiments/2026-12-06-selection-floor-qwen-4k/selection-floor-qwen-4k.toml",
                 "#8 of results/evolve/floor-qwen-4k/floor.sqlite", "#8 at floor 30",
                 "d62cb65ac603332666cad9b85f66a3ddce3f3914", f"results/evolve/picked-floor-qwen-4k/{_QWEN_PICKED}",
                 about="the floor rule's first step"),
    NamedProgram("qwen-pick-study", "qwen-pick-study.py", _QWEN,
                 "experiments/2026-12-06-matched-budget-study-qwen-2k/selection-study-qwen-2k.toml",
                 "#32 of results/evolve/compare-qwen-2k/evolve_random-s4.sqlite", "the study's #32",
                 "9bcc42a1db11557f65b2db53bd61dd46101f74e4", f"results/evolve/picked-study-qwen-2k/{_QWEN_PICKED}",
                 about="the matched-budget study's pick"),
    NamedProgram("qwen-pick-graded", "qwen-pick-graded.py", _QWEN,
                 "experiments/2026-12-05-graded-rule-rebuilt-qwen/selection-graded.toml",
                 "#22 of results/evolve/qwen-rescore.sqlite", "#323", "2dc23a6db0fdbbd27b984b5f9c3a756b0a7a3f67",
                 f"results/evolve/picked-graded/{_QWEN_PICKED}",
                 about="qwen-v2's #323 re-scored; the previous Qwen headline"),
    NamedProgram("qwen-pick-graded-refined", "qwen-pick-graded-refined.py", _QWEN,
                 "experiments/2026-12-06-graded-rule-refined-surrogate/selection-graded-refined.toml",
                 "#25 of results/evolve/qwen-rescore-refined.sqlite", "#25",
                 "9e80e2c3aba42d2c216dc8c0a6834db9ea8b5ac5", f"results/evolve/picked-graded-refined/{_QWEN_PICKED}",
                 surrogate="qwen2.5-coder-0.5b-instruct-signal-fit-affine", about="f.surrogate alone"),
    NamedProgram("qwen-pick-graded-refined-evolved", "qwen-pick-graded-refined-evolved.py", _QWEN,
                 "experiments/2026-12-06-evolution-from-refined-surrogate/selection-graded-refined-evolved.toml",
                 "#16 of results/evolve/qwen-evolve-refined.sqlite", "#16",
                 "327fb73c529c63ad996a8147550001ea9dc0a421",
                 f"results/evolve/picked-graded-refined-evolved/{_QWEN_PICKED}",
                 surrogate="qwen2.5-coder-0.5b-instruct-signal-fit-affine", about="evolved from the refined surrogate"),
    NamedProgram("qwen-pick", "qwen-pick.py", _QWEN, "configs/selection.toml",
                 "#325 of results/evolve/qwen-v2.sqlite", "#325", "6dac3e6120865012a67e70db5b85019def84eb86",
                 f"results/evolve/picked/{_QWEN_PICKED}", about="the first rule's Qwen pick"),
)
PROGRAMS: dict[str, NamedProgram] = {p.name: p for p in _PROGRAMS}


def program_file(spec: str | Path) -> Path:
    """The file of the named program ``spec``; any other value is a path, returned as one."""
    if isinstance(spec, str) and spec in PROGRAMS:
        return PROGRAM_DIR / PROGRAMS[spec].file
    return Path(spec)


@cache
def _named_by_digest() -> dict[str, str]:
    return {hashlib.sha256((PROGRAM_DIR / p.file).read_bytes()).hexdigest(): p.name for p in _PROGRAMS}


def program_name(path: str | Path) -> str | None:
    """The name of the program whose bytes the file ``path`` holds; None for any other file, or none there."""
    path = Path(path)
    try:
        if not path.is_file():
            return None
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
    return _named_by_digest().get(digest)
