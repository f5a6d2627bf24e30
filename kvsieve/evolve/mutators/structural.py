"""Mutators: propose a child program from a parent and a few inspirations.

The default, :class:`StructuralMutator`, needs no language model: it edits the syntax tree of the
parent's ``score`` (swap, add or drop signals, change pooling and kernel sizes, constants and
combination operators, crossover with an inspiration) and its ``SELECTION``. Every choice comes from
the ``rng`` the loop passes, so a run is reproducible. LLM mutators: ``local_model.py``, ``openai_compatible.py``.
"""

from __future__ import annotations

import ast
import copy
import random

from kvsieve.evolve.mutators.base import CHEAP_REPEAT_EDITS
from kvsieve.language.program_source import SELECTION_CHOICES, Program, ProgramError

__all__ = ["StructuralMutator", "OPERATIONS", "SELECTION_OPTIONS"]


# Signals a term can add, each (b, h, n) or broadcastable to it.
TERMS = (
    "group_mean(f.attn)", "group_max(f.attn)", "group_mean(f.last_attn)", "group_max(f.last_attn)",
    "pool(group_mean(f.attn), 9)", "max_pool(group_max(f.attn), 5)", "pool(group_max(f.last_attn), 5)",
    "f.value_norm", "1.0 / f.key_norm", "f.position", "rank(group_mean(f.attn))", "f.surrogate",
    "rank(f.surrogate)",
)
# the values a SELECTION edit (or a random program) draws from, per key
SELECTION_OPTIONS = {"chunk_size": (1, 2, 4, 8, 16), "sink": (0, 4, 8, 16), "floor": (0, 10, 20, 30, 40, 50),
                     **SELECTION_CHOICES}
SWAPS = {  # interchangeable names: same argument and result shapes
    "attn": ("last_attn",), "last_attn": ("attn",), "key_norm": ("value_norm",), "value_norm": ("key_norm",),
    "group_mean": ("group_max",), "group_max": ("group_mean",), "pool": ("max_pool",), "max_pool": ("pool",),
    "unit_mean": ("normalize", "rank"), "normalize": ("unit_mean", "rank"), "rank": ("unit_mean", "normalize"),
}
KERNELS = (1, 3, 5, 7, 9, 11, 15, 21, 31)
FACTORS = (0.25, 0.5, 0.8, 1.25, 2.0, 4.0)
OPERATIONS = ("constant", "kernel", "swap", "add_term", "drop_term", "operator", "wrap", "selection", "crossover")


def _score_def(tree: ast.Module) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "score":
            return node
    raise ProgramError("the program defines no score(f)")


def _final_return(fn: ast.FunctionDef) -> ast.Return | None:
    last = fn.body[-1] if fn.body else None
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    return last if isinstance(last, ast.Return) and len(returns) == 1 else None


def _expr(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


class StructuralMutator:
    """Syntax-tree edits; ``propose`` tries operations in random order until one applies."""

    name = "structural"
    repeat_edits = CHEAP_REPEAT_EDITS

    def __init__(self, operations: tuple[str, ...] = OPERATIONS, max_nodes: int = 400) -> None:
        unknown = [op for op in operations if op not in OPERATIONS]
        if unknown:
            raise ValueError(f"unknown mutation operation(s) {unknown}; allowed: {', '.join(OPERATIONS)}")
        self.operations = operations
        self.max_nodes = max_nodes  # bloat control: crossover and added terms only grow programs
        self.proposed = 0
        self.failed = 0
        self.last_operation = ""

    def propose(self, parent: Program, inspirations: list[Program], rng: random.Random) -> Program | None:
        self.proposed += 1
        order = list(self.operations)
        rng.shuffle(order)
        for op in order:
            try:
                tree = ast.parse(parent.source)
            except SyntaxError:
                break
            other = inspirations[rng.randrange(len(inspirations))] if inspirations else None
            if getattr(self, f"_{op}")(tree, rng, other):
                _drop_dead_assignments(_score_def(tree))
                if sum(1 for _ in ast.walk(tree)) > self.max_nodes:
                    continue
                _set_docstring(tree, f"Evolved: {op} of a parent program.")
                source = ast.unparse(ast.fix_missing_locations(tree)) + "\n"
                child = Program(source)
                try:
                    child.selection_params  # noqa: B018 - parses SELECTION, raises if out of range
                except ProgramError:
                    continue
                if child.code_hash != parent.code_hash:
                    self.last_operation = op
                    return child
        self.failed += 1
        return None

    # --- operations: edit ``tree`` in place, return whether anything changed ----------------------

    def _constant(self, tree, rng, other) -> bool:
        fn = _score_def(tree)
        kernel_args = {id(a) for n in ast.walk(fn) if isinstance(n, ast.Call) for a in n.args[1:]}
        consts = [n for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, float)
                  and id(n) not in kernel_args]
        if not consts:
            return False
        node = consts[rng.randrange(len(consts))]
        node.value = round(node.value * rng.choice(FACTORS), 4)
        return True

    def _kernel(self, tree, rng, other) -> bool:
        fn = _score_def(tree)
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id in ("pool", "max_pool") and len(n.args) == 2 and isinstance(n.args[1], ast.Constant)]
        if not calls:
            return False
        arg = calls[rng.randrange(len(calls))].args[1]
        choices = [k for k in KERNELS if k != arg.value]
        arg.value = rng.choice(choices)
        return True

    def _swap(self, tree, rng, other) -> bool:
        fn = _score_def(tree)
        spots = [n for n in ast.walk(fn) if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                                             and n.value.id == "f" and n.attr in SWAPS)
                 or (isinstance(n, ast.Name) and n.id in SWAPS and isinstance(n.ctx, ast.Load))]
        if not spots:
            return False
        node = spots[rng.randrange(len(spots))]
        if isinstance(node, ast.Attribute):
            node.attr = rng.choice(SWAPS[node.attr])
        else:
            node.id = rng.choice(SWAPS[node.id])
        return True

    def _add_term(self, tree, rng, other) -> bool:
        ret = _final_return(_score_def(tree))
        if ret is None or ret.value is None:
            return False
        weight = rng.choice((0.1, 0.2, 0.3, 0.5, 1.0))
        term = _expr(f"{weight} * unit_mean({rng.choice(TERMS)})")
        ret.value = ast.BinOp(left=ret.value, op=ast.Add(), right=term)
        return True

    def _drop_term(self, tree, rng, other) -> bool:
        fn = _score_def(tree)
        sums = [n for n in ast.walk(fn) if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub))]
        if not sums:
            return False
        target = sums[rng.randrange(len(sums))]
        keep = target.left if rng.random() < 0.5 else target.right
        return _replace(fn, target, keep)

    def _operator(self, tree, rng, other) -> bool:
        fn = _score_def(tree)
        ops = [n for n in ast.walk(fn) if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Mult))]
        if not ops:
            return False
        target = ops[rng.randrange(len(ops))]
        # torch.maximum takes two tensors: with a number on either side only the operator can change
        numeric = any(isinstance(side, ast.Constant) or (isinstance(side, ast.UnaryOp) and isinstance(
            side.operand, ast.Constant)) for side in (target.left, target.right))
        if rng.random() < 0.5 or numeric:
            target.op = ast.Mult() if isinstance(target.op, ast.Add) else ast.Add()
            return True
        call = _expr("torch.maximum(a, b)")
        call.args = [target.left, target.right]
        return _replace(fn, target, call)

    def _wrap(self, tree, rng, other) -> bool:
        ret = _final_return(_score_def(tree))
        if ret is None or ret.value is None:
            return False
        wrapper = _expr(f"{rng.choice(('pool', 'max_pool'))}(x, {rng.choice(KERNELS[1:6])})")
        wrapper.args[0] = ret.value
        ret.value = wrapper
        return True

    def _selection(self, tree, rng, other) -> bool:
        params = dict(Program(ast.unparse(tree)).selection_params)
        key = rng.choice(sorted(params))
        options = SELECTION_OPTIONS[key]
        params[key] = rng.choice([v for v in options if v != params[key]])
        assign = ast.parse(f"SELECTION = {params!r}").body[0]
        for i, node in enumerate(tree.body):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SELECTION"
                                                    for t in node.targets):
                tree.body[i] = assign
                return True
        tree.body.insert(1 if ast.get_docstring(tree) else 0, assign)
        return True

    def _crossover(self, tree, rng, other) -> bool:
        if other is None:
            return False
        try:
            other_fn = _score_def(ast.parse(other.source))
        except (SyntaxError, ProgramError):
            return False
        fn = _score_def(tree)
        mine, theirs = _final_return(fn), _final_return(other_fn)
        if mine is None or theirs is None or mine.value is None or theirs.value is None:
            return False
        other_fn = copy.deepcopy(other_fn)
        local = {t.id for n in ast.walk(other_fn) if isinstance(n, (ast.Assign, ast.AugAssign))
                 for t in ast.walk(n) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
        taken = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        suffix = next(f"_{k}" for k in range(1, 1000) if not any(f"{name}_{k}" in taken for name in local))
        for node in ast.walk(other_fn):
            if isinstance(node, ast.Name) and node.id in local:
                node.id = f"{node.id}{suffix}"
        weight = rng.choice((0.3, 0.5, 0.7))
        combined = _expr(f"{weight} * unit_mean(a) + {round(1 - weight, 2)} * unit_mean(b)")
        combined.left.right.args[0] = mine.value
        combined.right.right.args[0] = other_fn.body[-1].value
        fn.body = fn.body[:-1] + other_fn.body[:-1] + [ast.Return(value=combined)]
        return True


def _replace(root: ast.AST, target: ast.AST, new: ast.AST) -> bool:
    for parent in ast.walk(root):
        for name, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, name, new)
                return True
            if isinstance(value, list) and any(v is target for v in value):
                value[[i for i, v in enumerate(value) if v is target][0]] = new
                return True
    return False


def _drop_dead_assignments(fn: ast.FunctionDef) -> None:
    """Remove straight-line assignments whose names are never read afterwards (crossover leaves them)."""
    changed = True
    while changed:
        changed = False
        for i, node in enumerate(fn.body):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                continue
            name = node.targets[0].id
            later = [n for stmt in fn.body[i + 1:] for n in ast.walk(stmt)]
            read = any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in later)
            if not read:
                del fn.body[i]
                changed = True
                break


def _set_docstring(tree: ast.Module, text: str) -> None:
    doc = ast.Expr(value=ast.Constant(value=text))
    if ast.get_docstring(tree) is not None:
        tree.body[0] = doc
    else:
        tree.body.insert(0, doc)
