"""The map of docs/ARCHITECTURE.md, checked on the code. The floors and the "may import" table are read from the
page itself: every import of a kvsieve module points down (or stays in its own package) and is one its package's
row allows, no two files import each other through any chain, no kvsieve import is hidden inside a function
outside cli.py (the one place that defers heavy modules to the verb that needs them), the floors name every
package and top-level module, and the verbs the page and cli.py's docstring list are cli_arguments.VERBS."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvsieve"
PAGE = ROOT.parent / "docs" / "ARCHITECTURE.md"
BASE = 0  # policy.py, signals.py, selection.py, ... and the package's __init__


def _name(token: str) -> str:
    """``engine/`` -> ``engine``; ``models.py`` -> ``models``; ``harness/store.py`` -> ``harness.store``."""
    return token.removesuffix("/").removesuffix(".py").replace("/", ".")


def read_floors(text: str) -> tuple[dict[str, int], set[str]]:
    """(package or module above floor 0 -> its floor, the modules of floor 0), from the page's floors drawing: a line
    starting with its floor's digit, or with three spaces for another name on the floor above it."""
    block = text.split("## Floors", 1)[1].split("```")[1]
    floors: dict[str, int] = {}
    base: set[str] = set()
    floor = None
    for line in block.splitlines():
        if line[:1].isdigit():
            floor = int(line[0])
        elif not (line.startswith("   ") and line[3:4].strip()):
            continue  # a description carried over to the next line
        for token in line[3:].split():
            if not re.fullmatch(r"\w+(/|\.py)", token):
                break
            (base.add(_name(token)) if floor == 0 else floors.__setitem__(_name(token), floor))
    return floors, base


def read_table(text: str) -> dict[str, set[str] | None]:
    """The "may import" table: importer (a package, a top-level module, or ``kvsieve`` for floor 0) -> what it may
    import (package names, dotted module paths, ``kvsieve`` for floor 0); None: everything."""
    table: dict[str, set[str] | None] = {}
    rows = text.split("| package | may import |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    for row in rows:
        first, allowed = [cell.strip() for cell in row.strip("|").split("|")][:2]
        importer = "kvsieve" if first == "floor 0" else _name(first.strip("`"))
        if allowed == "everything":
            table[importer] = None
            continue
        names = {_name(t) for t in re.findall(r"`([^`]+)`", allowed)}
        table[importer] = names | ({"kvsieve"} if "floor 0" in allowed else set())
    return table


TEXT = PAGE.read_text()
FLOORS, BASE_MODULES = read_floors(TEXT)  # package (a folder of kvsieve, or a module at its top) -> floor
TABLE = read_table(TEXT)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The folder of kvsieve a module is in, its own name for models.py and cli.py, else the base floor."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "kvsieve"


def floor_of(module: str) -> int:
    return FLOORS.get(package_of(module), BASE)


def is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def imports(path: Path) -> tuple[set[str], list[tuple[int, str]]]:
    """(kvsieve modules imported at module level, (line, module) imported inside a function)."""
    tree = ast.parse(path.read_text())
    top, nested = set(), []
    functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from kvsieve.x import y" imports the module kvsieve.x.y when y is one, else a name of kvsieve.x
            modules = [f"{node.module}.{a.name}" for a in node.names if is_module(f"{node.module}.{a.name}")]
            names = modules + ([node.module] if len(modules) < len(node.names) else [])
        for name in names:
            if name == "kvsieve" or name.startswith("kvsieve."):
                (nested.append((node.lineno, name)) if id(node) in functions else top.add(name))
    return top, nested


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p)[0] for p in ROOT.rglob("*.py")}


def test_the_floors_name_every_package_and_module_once():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    named = set(FLOORS) | BASE_MODULES
    assert packages | modules == named, (f"without a floor: {sorted(packages | modules - named)}; "
                                         f"not in kvsieve: {sorted(named - packages - modules)}")
    assert not set(FLOORS) & BASE_MODULES
    # what the code and the design say (DESIGN.md's arrows): a sanity check on the page's reading
    assert FLOORS["engine"] == FLOORS["distributed"] == 1 and FLOORS["policies"] == 2 and FLOORS["cli"] == 7
    assert FLOORS["risk"] > FLOORS["harness"] and FLOORS["serve"] > FLOORS["risk"]


def test_the_may_import_table_has_a_row_for_every_package():
    assert set(TABLE) == set(FLOORS) | {"kvsieve"}, sorted(set(TABLE) ^ (set(FLOORS) | {"kvsieve"}))
    for importer, allowed in TABLE.items():
        for name in allowed or ():
            assert name == "kvsieve" or is_module(f"kvsieve.{name}"), f"row {importer!r} names {name!r}, no module"


def allowed_by_table(importer: str, target: str) -> bool:
    """Whether the page's row for ``importer``'s package lets it import ``target`` (a module of another package)."""
    allowed = TABLE[package_of(importer)]
    if allowed is None:
        return True
    relative = target.removeprefix("kvsieve.")
    return any(relative == name or relative.startswith(name + ".") for name in allowed) or (
        package_of(target) == "kvsieve" and "kvsieve" in allowed)


def test_every_import_is_one_the_may_import_table_allows():
    wrong = sorted(f"{importer} -> {target} ({package_of(importer)}'s row allows "
                   f"{', '.join(sorted(TABLE[package_of(importer)] or ['everything']))})"
                   for importer, targets in graph().items() for target in targets
                   if package_of(importer) != package_of(target) and not allowed_by_table(importer, target))
    assert not wrong, "imports docs/ARCHITECTURE.md's table does not allow:\n" + "\n".join(wrong)


def test_the_table_refuses_an_import_it_does_not_list():
    """The check itself: an import the rows do not name is refused, a listed module or package is allowed."""
    assert not allowed_by_table("kvsieve.risk.losses", "kvsieve.models")  # risk reads results, never a model
    assert not allowed_by_table("kvsieve.risk.losses", "kvsieve.harness.evaluate")  # only harness/store.py
    assert allowed_by_table("kvsieve.risk.losses", "kvsieve.harness.store")
    assert not allowed_by_table("kvsieve.engine.compress", "kvsieve.policies.registry")
    assert allowed_by_table("kvsieve.engine.compress", "kvsieve.selection")
    assert not allowed_by_table("kvsieve.learn.train", "kvsieve.evolve.search")
    assert not allowed_by_table("kvsieve.tasks.ruler", "kvsieve.selection")
    assert allowed_by_table("kvsieve.cli", "kvsieve.serve.app")


def verbs() -> list[str]:
    """The keys of cli_arguments.VERBS, read from the source (no import: it is the CLI's table)."""
    tree = ast.parse((ROOT / "cli_arguments.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and "VERBS" in ast.unparse(node).split("=")[0]:
            return [key.value for key in node.value.keys]
    raise AssertionError("cli_arguments.py has no VERBS")


def test_the_page_and_the_cli_docstring_list_every_verb():
    expected = verbs()
    assert {"eval", "pick", "certify", "serve"} <= set(expected)
    docstring = ast.get_docstring(ast.parse((ROOT / "cli.py").read_text())).splitlines()[0]
    listed = docstring.split("kvsieve", 1)[1].rstrip(".").split("|")
    assert [v.strip() for v in listed] == expected, docstring
    line = next(line for line in TEXT.splitlines() if line.startswith("7  cli.py"))
    assert [v.strip() for v in line.split("the verbs:", 1)[1].split(",")] == expected, line


def test_every_import_points_down_or_stays_in_its_package():
    wrong = []
    for importer, targets in graph().items():
        for target in targets:
            same = package_of(importer) == package_of(target)
            if not same and target != "kvsieve" and floor_of(target) >= floor_of(importer):
                wrong.append(f"{importer} (floor {floor_of(importer)}) -> {target} (floor {floor_of(target)})")
    assert not wrong, "imports that do not point down:\n" + "\n".join(sorted(wrong))


def test_no_file_imports_itself_through_a_chain():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if nxt not in edges:
                continue
            if state.get(nxt) == 1:
                return path + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            assert visit(start, [start]) is None


def test_no_kvsieve_import_hides_in_a_function_outside_the_cli():
    hidden = [f"{p.relative_to(ROOT.parent)}:{line} imports {name}" for p in ROOT.rglob("*.py") if p.name != "cli.py"
              for line, name in imports(p)[1]]
    assert not hidden, "\n".join(hidden)
