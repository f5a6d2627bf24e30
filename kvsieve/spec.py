"""Policy spec strings: ``name``, ``name(key=value, ...)`` and ``program:NAME|PATH``, parsed without building anything.

Pure text (no torch), so the CLI and grid checks can read specs before the heavy modules load.
"""

from __future__ import annotations

import ast

__all__ = ["PROGRAM_PREFIX", "parse_spec", "split_specs", "format_spec"]

PROGRAM_PREFIX = "program:"


def split_specs(text: str) -> list[str]:
    """Comma-separated policy specs; a comma inside parentheses belongs to its spec (`snapkv(a=1, b=2)`)."""
    specs, depth, current = [], 0, ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            specs.append(current)
            current = ""
        else:
            current += char
    return [s.strip() for s in [*specs, current] if s.strip()]


def parse_spec(spec: str) -> tuple[str, dict]:
    """Split ``name(key=value, ...)`` into the name and literal parameters; ``program:NAME|PATH`` -> path."""
    spec = spec.strip()
    if spec.startswith(PROGRAM_PREFIX):
        path = spec[len(PROGRAM_PREFIX):].strip()
        if not path:
            raise ValueError(f"bad policy spec {spec!r}: expected program:NAME or program:PATH to an evolved program "
                             "file")
        return "program", {"path": path}
    if "(" not in spec:
        return spec, {}
    if not spec.endswith(")"):
        raise ValueError(f"bad policy spec {spec!r}: expected name or name(key=value, ...)")
    name, args = spec[:-1].split("(", 1)
    try:
        call = ast.parse(f"f({args})", mode="eval").body
        params = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"bad policy spec {spec!r}: {err}") from err
    if call.args or None in params:
        raise ValueError(f"bad policy spec {spec!r}: parameters must be key=value literals")
    return name.strip(), params


def format_spec(name: str, params: dict) -> str:
    """The spec text of a family and its literal parameters, which :func:`parse_spec` reads back: ``program:PATH``
    for a program given by its path alone, else ``name(key=value, ...)`` in the parameters' order."""
    if name == "program" and list(params) == ["path"] and isinstance(params["path"], str):
        return f"{PROGRAM_PREFIX}{params['path']}"
    if not params:
        return name
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in params.items())})"
