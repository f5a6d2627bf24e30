"""A policy read from a program file: what ``kvsieve evolve`` exports (``--policies program:best.py``), or a named one.

``program:NAME`` runs a program kvsieve ships by name (``kvsieve/language/shipped_programs.py``: the selection rules'
picks, such as ``program:qwen-pick-floor-high``); any other value is a file's path, and a file holding a named
program's bytes is keyed by its name. The file is an evolved program (``kvsieve/language/program_source.py``
format). It is never run as Python: it passes the same static check as a candidate's stage 0 and is then interpreted
(``kvsieve/language/interpreter.py``) against the compact interface
(:class:`kvsieve.language.program_features.Features`), every operation costed against budgets that scale with
the layer before it runs, so a program that misbehaves on long inputs (a "sleeper") stops with an error
naming the limit instead of hanging or exhausting memory. ``deadline_s=`` bounds the wall-clock time of
one layer's scoring; ``max_elements=`` the size of any tensor it creates (an absolute backstop).

Everything a program can cause while scoring (a refused operation, a budget, its own error, scores of
the wrong shape or not finite) raises one exception type, :class:`~kvsieve.language.interpreter.InterpreterError`
(a ``ValueError``): a caller (the harness, the server) catches it and fails that cell or request alone.

A program that reads ``f.surrogate`` gets the predictions of a KVzip surrogate (``kvzap``):
``surrogate=NAME|PATH`` names its checkpoint (a shipped or named kvzap checkpoint's name, or a file); without it the
harness binds the shipped surrogate of the model the cell runs on (:meth:`ProgramPolicy.check_model`), and a
program used without either is refused. The surrogate reads a cache whose KV heads hold the same positions: prefill
compression, not decode-time eviction.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from kvsieve.language.interpreter import InterpreterError, Limits, ProgramFailed, ScoreProgram, run_budget
from kvsieve.language.program_features import Features
from kvsieve.language.program_source import Program, ProgramError
from kvsieve.language.shipped_programs import program_file, program_name
from kvsieve.networks.shipped import checkpoint_name, resolve_checkpoint, shipped_files
from kvsieve.policies.kvzap import KVzap, shipped_kvzap_for
from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals

__all__ = ["ProgramPolicy", "program_spec", "run_budget", "InterpreterError"]

DEFAULT_LIMITS = Limits()
PARSED_CACHE_SIZE = 256  # distinct program texts kept parsed (an evolution builds many candidates from source)

# source text -> (the parsed score function, the program): each text is checked and parsed once per process, however
# many times a spec builds its policy (every cell of a grid does); a changed file is a new text, parsed again
_PARSED: OrderedDict[str, tuple[ScoreProgram, Program]] = OrderedDict()
_PARSED_LOCK = threading.Lock()


def _parsed(source: str, label: str) -> tuple[ScoreProgram, Program]:
    """The static check, parse and SELECTION of ``source``, done once per text (errors are not kept: a bad program
    raises each time, named by ``label``)."""
    with _PARSED_LOCK:
        hit = _PARSED.get(source)
        if hit is not None:
            _PARSED.move_to_end(source)
            return hit
    parsed = ScoreProgram(source, filename=label)
    program = Program(source)
    program.selection_params  # noqa: B018 - validates SELECTION now, naming the file
    with _PARSED_LOCK:
        _PARSED[source] = (parsed, program)
        while len(_PARSED) > PARSED_CACHE_SIZE:
            _PARSED.popitem(last=False)
    return parsed, program


def program_spec(path: str | Path, surrogate: str | None = None) -> str:
    """The policy spec that evaluates the program file ``path``, over the kvzap checkpoint it was scored over if any
    (the values as Python literals: a path holding a quote still reads back)."""
    if surrogate is None:
        return f"program:{path}"
    return f"program(path={str(path)!r}, surrogate={str(surrogate)!r})"


def _read(path: str) -> str:
    """The text of the program ``path`` names (a named program, else a file)."""
    file = program_file(path)
    if not file.is_file():
        raise ValueError(f"program file {path!r} does not exist")
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"program file {path!r} cannot be read: {err}") from None


class ProgramPolicy(Policy):
    name = "program"
    # the program's SELECTION states how its scores compare: standardised per head before a shared budget
    # ("normalization": "zscore", the default) or already on one scale ("none")
    comparable_across_heads = comparable_across_layers = True

    def __init__(self, path: str | None = None, source: str | None = None, deadline_s: float | None = None,
                 max_elements: int | None = None, surrogate: str | None = None, **kwargs) -> None:
        if (path is None) == (source is None):
            raise ValueError("give exactly one of path= (a program file) or source=")
        label = path or "<program>"
        if path is not None:
            source = _read(path)
        limits = Limits(deadline_s=DEFAULT_LIMITS.deadline_s if deadline_s is None else deadline_s,
                        max_elements=DEFAULT_LIMITS.max_elements if max_elements is None else max_elements)
        if not isinstance(source, str):
            raise ValueError(f"{label}: source must be a str, got {type(source).__name__}")
        try:
            parsed, self.program = _parsed(source, label)
        except (InterpreterError, ProgramError) as err:
            text = str(err)
            raise ValueError(text if text.startswith(label) else f"{label}: {text}") from None
        # this policy's own copy of the parsed function (the syntax tree is shared, never changed): its limits,
        # the name its errors give, and the cost of its last call
        self._score = copy.copy(parsed)
        self._score.limits, self._score.filename = limits, label
        self.path = path
        self.reads_surrogate = "surrogate" in self._score.fields
        self.surrogate = KVzap(checkpoint=surrogate) if surrogate is not None else None
        super().__init__(**kwargs)

    def check_model(self, model, name: str | None = None) -> None:
        """Bind the shipped surrogate of ``model`` when the program reads ``f.surrogate`` and none was given."""
        if not self.reads_surrogate:
            return
        if self.surrogate is not None:
            self.surrogate.check_model(model, name)
            return
        self.surrogate = shipped_kvzap_for(model, name)
        if self.surrogate is None:
            raise ValueError(f"program {self.path or '<source>'} reads f.surrogate, but no kvzap surrogate ships for "
                             f"model {name or type(model).__name__!r}: train one (`kvsieve train --objective kvzap`) "
                             "and pass program(path=..., surrogate='DIR')")

    @property
    def needs_hidden_states(self) -> bool:  # a surrogate that reads hidden states needs the engine to keep them
        return self.surrogate is not None and self.surrogate.needs_hidden_states

    @classmethod
    def content_paths(cls, path: str | None = None, surrogate: str | None = None, **_) -> tuple[Path, ...]:
        """The program file and, when it reads ``f.surrogate``, the surrogate's checkpoint: the one named, else
        every shipped one (the harness binds the model's), so its rows are recomputed when either changes."""
        if path is None:
            return ()
        file = program_file(path)
        if not _reads_surrogate(file):
            return (file,)
        if surrogate is not None:
            return (file, resolve_checkpoint("kvzap", surrogate))
        return (file, *shipped_files("kvzap"))

    @classmethod
    def named_params(cls, **params) -> dict:
        """A path to a named program's bytes as its name, a surrogate's path to a shipped or named checkpoint's bytes
        as that name."""
        out = dict(params)
        if isinstance(params.get("path"), str):
            out["path"] = program_name(program_file(params["path"])) or params["path"]
        if isinstance(params.get("surrogate"), str):
            out["surrogate"] = checkpoint_name("kvzap", params["surrogate"]) or params["surrogate"]
        return out

    def default_selection(self) -> Selection:
        return self.program.selection(self.window)

    def score(self, signals: Signals) -> torch.Tensor:
        predicted = None
        if self.reads_surrogate:
            if self.surrogate is None:
                raise ValueError(f"program {self.path or '<source>'} reads f.surrogate but has no surrogate: pass "
                                 "program(path=..., surrogate=NAME|PATH) or run it through kvsieve eval, which binds "
                                 "the shipped surrogate of the model")
            predicted = self.surrogate.score(signals)
        label = self.path or "<source>"
        try:
            scores = self._score(Features.from_signals(signals, predicted))
        except InterpreterError as err:  # the same class (a limit, the program's own error), named by the file
            raise type(err)(f"program {label} stopped: {err}") from None
        expected = (signals.batch_size, signals.num_kv_heads, signals.seq_len)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
            raise ProgramFailed(f"program {label} returned {getattr(scores, 'shape', type(scores))}, expected "
                                f"scores shaped {expected}")
        if not scores.is_floating_point() or not bool(torch.isfinite(scores).all()):
            # as stage 1 refuses them: NaN would be read as "never keep", inf as "always keep"
            raise ProgramFailed(f"program {label} returned scores that are not all finite floats "
                                f"(layer {signals.layer_idx}, dtype {scores.dtype})")
        return scores.float()

    def __repr__(self) -> str:
        return f"ProgramPolicy(path={self.path!r}, window={self.window}, selection={self.selection})"


def _reads_surrogate(path: Path) -> bool:
    """Whether the program in ``path`` reads ``f.surrogate``. The program is checked here, when its spec is parsed
    (a grid, a contract, the server's points): a file that is not a program is refused before any work, naming the
    file and line."""
    source = _read(str(path))
    try:
        return "surrogate" in _parsed(source, str(path))[0].fields
    except (InterpreterError, ProgramError) as err:
        text = str(err)
        raise ValueError(text if text.startswith(str(path)) else f"{path}: {text}") from None
