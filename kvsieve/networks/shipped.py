"""The checkpoints kvsieve ships, and the one way to turn a checkpoint argument into a file.

Two families read checkpoints: ``learned`` (DistillCache's keep network) and ``kvzap`` (the KVzip surrogate).
A policy's ``checkpoint=`` is a shipped name (the model it was trained for; aliases resolve), the name of a further
checkpoint (:data:`NAMED`), a file, or a ``kvsieve train`` output folder holding ``policy.safetensors``. How each
shipped file was trained is in its metadata and in docs/kvzap.md (kvzap) and docs/learning.md (learned, and the
named ones). A file with a shipped or named checkpoint's bytes is keyed by that name (:func:`checkpoint_name`).
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from kvsieve.bundled import canonical_name

__all__ = ["CHECKPOINT_DIR", "KINDS", "SHIPPED", "NAMED", "HOW_TO_TRAIN", "resolve_checkpoint", "shipped_names",
           "shipped_files", "checkpoint_name"]

CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"
# (family, the model it was trained for) -> file in CHECKPOINT_DIR
SHIPPED: dict[tuple[str, str], str] = {
    ("learned", "smollm2-135m-instruct"): "smollm2-135m-instruct.safetensors",
    ("learned", "qwen2.5-coder-0.5b-instruct"): "qwen2.5-coder-0.5b-instruct.safetensors",
    ("kvzap", "smollm2-135m-instruct"): "kvzap-smollm2-135m-instruct.safetensors",
    ("kvzap", "qwen2.5-coder-0.5b-instruct"): "kvzap-qwen2.5-coder-0.5b-instruct.safetensors",
}
# further checkpoints, by a name of their own: name -> (family, file in CHECKPOINT_DIR). Never a model's default
# (shipped_names, shipped_files and the surrogate a program binds read SHIPPED alone), so none changes a stored key.
NAMED: dict[str, tuple[str, str]] = {
    # the refined Qwen surrogate (issue 51): configs/train-kvzap-qwen-signal-fit-affine.toml, seed 5000 (the declared
    # run), the checkpoint its stopping rule kept; byte for byte results/learned/issue51/signal-fit-affine-qwen-s5000
    "qwen2.5-coder-0.5b-instruct-signal-fit-affine": (
        "kvzap", "kvzap-qwen2.5-coder-0.5b-instruct-signal-fit-affine.safetensors"),
}
KINDS = ("learned", "kvzap")
HOW_TO_TRAIN = {
    "learned": "train one with `kvsieve train --model MODEL --out DIR` and use learned(checkpoint='DIR')",
    "kvzap": "train one with `kvsieve train --objective kvzap --model MODEL --out DIR` and use kvzap(checkpoint='DIR')",
}
TRAINED_FILE = "policy.safetensors"  # what `kvsieve train --out DIR` writes


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"checkpoint family {kind!r} is not one of {', '.join(map(repr, KINDS))}")


def shipped_names(kind: str) -> list[str]:
    """The models a ``kind`` checkpoint ships for whose file is present, sorted."""
    _check_kind(kind)
    return sorted(model for family, model in SHIPPED if family == kind
                  and (CHECKPOINT_DIR / SHIPPED[family, model]).is_file())


def shipped_files(kind: str) -> tuple[Path, ...]:
    """The shipped ``kind`` checkpoint files that are present, in the order of their models' names."""
    return tuple(CHECKPOINT_DIR / SHIPPED[kind, name] for name in shipped_names(kind))


def _names(kind: str) -> dict[str, Path]:
    """Every name of a ``kind`` checkpoint whose file is present (the models' canonical names, then NAMED's) -> file."""
    named = {name: CHECKPOINT_DIR / file for name, (family, file) in NAMED.items() if family == kind}
    return {name: path for name, path in [*zip(shipped_names(kind), shipped_files(kind)), *named.items()]
            if path.is_file()}


def resolve_checkpoint(kind: str, spec: str | Path | None) -> Path:
    """A ``kind`` checkpoint file from a shipped or named checkpoint's name, a file path, or a ``kvsieve train``
    output folder."""
    _check_kind(kind)
    shipped = ", ".join(_names(kind)) or "none yet"
    if spec is None:
        raise ValueError(f"{kind} needs checkpoint=NAME or PATH (shipped: {shipped}); {HOW_TO_TRAIN[kind]}")
    if isinstance(spec, str):
        path = _names(kind).get(canonical_name(spec))
        if path is not None:
            return path
    path = Path(spec)
    if path.is_dir() and (path / TRAINED_FILE).is_file():
        return path / TRAINED_FILE
    if path.is_file():
        return path
    raise ValueError(f"{kind} checkpoint {str(spec)!r} is neither a file nor a shipped name (shipped: {shipped}); "
                     f"{HOW_TO_TRAIN[kind]}")


@cache
def _sha256(path: Path, size: int, mtime_ns: int) -> str:  # keyed by size and time: a rewritten file is read again
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest(path: Path) -> str:
    stat = path.stat()
    return _sha256(path, stat.st_size, stat.st_mtime_ns)


def checkpoint_name(kind: str, spec: str | Path) -> str | None:
    """The name of the shipped or named ``kind`` checkpoint whose bytes the file or run folder ``spec`` holds; None
    for a name (it names itself), a file no name has, or a path that is no checkpoint."""
    _check_kind(kind)
    names = _names(kind)
    if isinstance(spec, str) and canonical_name(spec) in names:
        return None
    try:
        path = resolve_checkpoint(kind, spec)
        size = path.stat().st_size
        same_size = [name for name, file in names.items() if file.stat().st_size == size]
        digest = _digest(path) if same_size else None
    except (ValueError, OSError):
        return None
    return next((name for name in same_size if _digest(names[name]) == digest), None)
