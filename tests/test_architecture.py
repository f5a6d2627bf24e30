"""The floors of docs/ARCHITECTURE.md, checked on the code: every import of a kvsieve module points down (or stays
in its own package), no two files import each other through any chain, and no kvsieve import is hidden inside a
function outside cli.py (the one place that defers heavy modules to the verb that needs them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvsieve"

# package (a folder of kvsieve, or a module at its top) -> floor; the table in docs/ARCHITECTURE.md
FLOORS = {
    "engine": 1, "language": 1, "networks": 1, "models": 1, "tasks": 1, "distributed": 1,
    "policies": 2,
    "harness": 3, "evolve": 3, "learn": 3,
    "risk": 4,
    "serve": 5,
    "cli_arguments": 6,
    "cli": 7,
}
BASE = 0  # policy.py, signals.py, selection.py, ... and the package's __init__


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


def test_the_floors_table_names_every_package():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(FLOORS), f"packages without a floor: {sorted(packages - set(FLOORS))}"


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
