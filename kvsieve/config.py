"""The one loader for configuration files: TOML, JSON or YAML into a config dataclass, with one set of errors.

Every command that takes ``--config`` (``eval``, ``evolve``, ``train``) goes through
:func:`load_config`: the file's keys must be fields of the dataclass (unknown keys are named with the
allowed ones), flags given on the command line override the file (``None`` means "not given"), and
every error names the file.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["load_config", "read_config_file", "SUFFIXES"]

T = TypeVar("T")
SUFFIXES = (".toml", ".json", ".yaml", ".yml")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The table a config file holds; ValueError naming the file on a missing file, bad syntax or a non-table."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {path} does not exist")
    if file.suffix not in SUFFIXES:
        raise ValueError(f"config file {path}: use one of {', '.join(SUFFIXES)}")
    try:
        text = file.read_text(encoding="utf-8")
        if file.suffix == ".toml":
            data = tomllib.loads(text)
        elif file.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml  # optional: PyYAML comes with transformers

            data = yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"config file {path}: cannot read it: {err}") from None
    except Exception as err:  # yaml.YAMLError, without importing yaml for the other formats
        raise ValueError(f"config file {path}: cannot read it: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a table of keys, got {type(data).__name__}")
    return data


def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """``cls(**file values, **non-None overrides)``; errors (unknown keys, bad values) name the file."""
    values: dict[str, Any] = read_config_file(path) if path is not None else {}
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ValueError(f"config file {path}: unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"config file {path}: {err}" if path is not None else str(err)) from None
