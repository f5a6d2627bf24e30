"""Write docs/reference.md from the code: every verb's flags (kvsieve.cli_arguments), every policy family's
parameters (the registry) and the named programs and checkpoints (their tables).
``python docs/make_reference.py > docs/reference.md``; tests/test_reference.py fails when the page and the code
disagree."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import MISSING, fields

from kvsieve.cli_arguments import build_parser
from kvsieve.language.shipped_programs import PROGRAMS
from kvsieve.networks.shipped import NAMED, SHIPPED
from kvsieve.policies.registry import _parameters, families, family_class
from kvsieve.selection import Selection

HEADER = """# CLI and spec reference

Generated from the code by `python docs/make_reference.py > docs/reference.md` (`tests/test_reference.py` fails
when this page and the code disagree). Task-oriented pages: [README](../README.md),
[policies](policies.md), [write your own policy](custom-policy.md).
"""


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.choices:
            names += " " + "/".join(map(str, action.choices))
        value = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
        default = "" if value in (None, False, "", argparse.SUPPRESS) else f"`{value}`"
        required = " (required)" if action.required else ""
        rows.append(f"| {names} | {default} | {_cell((action.help or '') % vars(action) if action.help else '')}"
                    f"{required} |")
    return rows


def _summary(cls: type) -> str:
    # one family per file, its paper in the module docstring; FullCache shares policy.py with the interface
    module = inspect.getmodule(cls)
    doc = (inspect.getdoc(cls) if module.__name__ == "kvsieve.policy" else inspect.getdoc(module)) or ""
    return _cell(doc.split("\n\n")[0])


def _signature(cls: type) -> str:
    shown = []
    for name in sorted(_parameters(cls)):
        default = None
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None and name in inspect.signature(init).parameters:
                default = inspect.signature(init).parameters[name].default
                break
        shown.append(f"`{name}`" + ("" if default in (None, inspect.Parameter.empty) else f"=`{default!r}`"))
    return ", ".join(shown) or "none"


def reference() -> str:
    parser = build_parser()
    lines = [HEADER, "## Global flags", "", "`kvsieve [global flags] VERB [flags]`", "", *_flags(parser), ""]
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in verbs._choices_actions}
    for name, sub in verbs.choices.items():
        lines += [f"## `kvsieve {name}`", "", _cell(helps.get(name, "")), "", *_flags(sub), ""]
    lines += ["## Policy specs", "",
              "A spec is `name`, `name(key=value, ...)` with Python literals, or `program:NAME` / `program:PATH`. "
              "Lists of specs are "
              "comma-separated; a comma inside parentheses belongs to its spec. Kinds: `policy` (ready to build), "
              "`file` (defined by a program or checkpoint file, whose sha256 keys the results), `reference` (the "
              "answer-span oracle, a reference line only).", "",
              "| family | kind | parameters | what it is |", "|---|---|---|---|"]
    for name, kind in families().items():
        cls = family_class(name)
        lines.append(f"| `{name}` | {kind} | {_signature(cls)} | {_summary(cls)} |")
    lines += ["", "### Named programs", "",
              "`program:NAME` (or `program(path='NAME', ...)`) runs a program kvsieve ships "
              "(`kvsieve/language/shipped_programs.py`): each is, byte for byte, the file `kvsieve pick` wrote when "
              "its rule picked it. A program file given by its path whose bytes are a named one's is keyed by the name "
              "in the results store; `python -m kvsieve.harness.migrate STORE` renames rows stored under such a path.",
              "", "| name | model | rule (`kvsieve pick --config`) | it printed | the results pages' name | "
              "the file it wrote (commit) |",
              "|---|---|---|---|---|---|"]
    for p in PROGRAMS.values():
        over = f"; over `surrogate='{p.surrogate}'`" if p.surrogate else ""
        lines.append(f"| `{p.name}` | {p.model} | `{p.rule}` | {p.picked} | {_cell(p.known_as)} "
                     f"({_cell(p.about)}{over}) | `{p.origin}` ({p.commit[:7]}) |")
    lines += ["", "### Named checkpoints", "",
              "`learned(checkpoint=NAME)`, `kvzap(checkpoint=NAME)` and a program's `surrogate=NAME` take the name of "
              "the checkpoint shipped for a bundled model (an alias of the model resolves), which a program reading "
              "`f.surrogate` gets by default, or a further checkpoint's name; a file with a named checkpoint's bytes "
              "is keyed by the name.", "", "| name | family | file (`kvsieve/networks/checkpoints/`) |",
              "|---|---|---|"]
    for (family, model), file in sorted(SHIPPED.items(), key=lambda item: (item[0][1], item[0][0])):
        lines.append(f"| `{model}` | {family} (the model's) | `{file}` |")
    for name, (family, file) in NAMED.items():
        lines.append(f"| `{name}` | {family} | `{file}` |")
    lines += ["", "### Selection fields", "",
              "Any of these composes with a family that does not take it itself: `tova(allocation='layer')` is "
              "TOVA's scores under AdaKV's allocation, `knorm(chunk_size=8)` KNorm's under ChunkKV's chunks.", "",
              "| field | default |", "|---|---|"]
    for f in fields(Selection):
        default = f.default if f.default is not MISSING else f.default_factory() if f.default_factory is not MISSING \
            else ""
        lines.append(f"| `{f.name}` | `{default!r}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
