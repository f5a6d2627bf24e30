"""The checkpoints kvsieve ships, and the one way to turn a checkpoint argument into a file.

Two families read checkpoints: ``learned`` (DistillCache's keep network) and ``kvzap`` (the KVzip surrogate).
A policy's ``checkpoint=`` is a shipped name (the model it was trained for; aliases resolve), a file, or a
``kvsieve train`` output folder holding ``policy.safetensors``. How each shipped file was trained is in its
metadata and in docs/kvzap.md (kvzap) and the README's "Learn" section (learned).
"""

from __future__ import annotations

from pathlib import Path

from kvsieve.bundled import canonical_name

__all__ = ["CHECKPOINT_DIR", "KINDS", "SHIPPED", "HOW_TO_TRAIN", "resolve_checkpoint", "shipped_names",
           "shipped_files"]

CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"
# (family, the model it was trained for) -> file in CHECKPOINT_DIR
SHIPPED: dict[tuple[str, str], str] = {
    ("learned", "smollm2-135m-instruct"): "smollm2-135m-instruct.safetensors",
    ("learned", "qwen2.5-coder-0.5b-instruct"): "qwen2.5-coder-0.5b-instruct.safetensors",
    ("kvzap", "smollm2-135m-instruct"): "kvzap-smollm2-135m-instruct.safetensors",
    ("kvzap", "qwen2.5-coder-0.5b-instruct"): "kvzap-qwen2.5-coder-0.5b-instruct.safetensors",
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


def resolve_checkpoint(kind: str, spec: str | Path | None) -> Path:
    """A ``kind`` checkpoint file from a shipped name, a file path, or a ``kvsieve train`` output folder."""
    _check_kind(kind)
    shipped = ", ".join(shipped_names(kind)) or "none yet"
    if spec is None:
        raise ValueError(f"{kind} needs checkpoint=NAME or PATH (shipped: {shipped}); {HOW_TO_TRAIN[kind]}")
    if isinstance(spec, str) and (kind, canonical_name(spec)) in SHIPPED:
        path = CHECKPOINT_DIR / SHIPPED[kind, canonical_name(spec)]
        if path.is_file():
            return path
    path = Path(spec)
    if path.is_dir() and (path / TRAINED_FILE).is_file():
        return path / TRAINED_FILE
    if path.is_file():
        return path
    raise ValueError(f"{kind} checkpoint {str(spec)!r} is neither a file nor a shipped name (shipped: {shipped}); "
                     f"{HOW_TO_TRAIN[kind]}")
