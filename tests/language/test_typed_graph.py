"""The language's parser and types: what a program may say, each shape inferred, every refusal naming its line.

The reproducers of issue 48 (each a way a hostile author hung or flooded the old interpreter) are refused here,
by the parser, before anything runs: the language cannot express them.
"""

from __future__ import annotations

import time

import pytest

from kvsieve.language import operations as ops
from kvsieve.language.static_check import StaticCheckError, check_source
from kvsieve.language.typed_graph import ProgramRefused, build_graph


def body(*lines: str) -> str:
    return "def score(f):\n" + "".join(f"    {line}\n" for line in lines)


def test_shapes_are_inferred_for_every_node_and_common_subexpressions_are_one_node():
    graph = build_graph(body("a = group_mean(f.attn)", "b = group_mean(f.attn)",
                             "return 0.5 * unit_mean(a) + pool(b, 9) * f.position + f.layer"))
    shapes = {(n.kind, n.name): n.shape for n in graph.nodes}
    assert shapes[("feature", "attn")] == ("b", "h", "g", "n")
    assert shapes[("call", "group_mean")] == ("b", "h", "n")
    assert shapes[("feature", "position")] == ("n",) and shapes[("feature", "layer")] == ()
    assert graph.nodes[graph.output].shape == ("b", "h", "n")
    assert sum(1 for n in graph.nodes if n.name == "group_mean") == 1  # a and b are one value
    assert graph.fields == {"attn", "position", "layer"}


def test_numbers_fold_and_stay_bounded():
    graph = build_graph(body("return (2 * 3 - 1) ** 2 * f.key_norm"))
    assert [graph.nodes[i].value for i in graph.live_nodes() if graph.nodes[i].kind == "literal"] == [25.0]
    with pytest.raises(ProgramRefused, match="line 2: the numbers cannot be combined"):
        build_graph(body("return 1 / (1 - 1) * f.key_norm"))


@pytest.mark.parametrize("source,match", [
    # issue 48's reproducers, none of them expressible
    (body("k = 10 ** 9", "return f.key_norm * round(7, -k)"),
     r"line 2: the exponent of \*\* must be an int literal in \[-4, 4\], got 9"),
    (body("return f.key_norm * round(7, -3)"), "line 2: 'round' is not an operation of the language"),
    (body("x = f.key_norm", "x += f.value_norm", "return x"),
     r"line 3: augmented assignment \(x \+= y\) is not allowed"),
    (body("m = f.attn > 0", "return group_mean(f.attn[m])"), "line 2: a comparison is not allowed"),
    (body("return group_mean(f.attn)[0]"), "line 2: indexing is not allowed"),
    (body("return torch.where(f.key_norm)"), "'torch.where' is not an operation of the language"),
    (body("return torch.stack([f.key_norm] * 4096)"), "'torch.stack' is not an operation of the language"),
    (body("return torch.roll(f.key_norm, 1)"), "'torch.roll' is not an operation of the language"),
    (body("t = (f.key_norm,) * 4096", "return f.key_norm"), "line 2: a tuple is not allowed"),
    (body("return f.key_norm * 10 ** 10 ** 6"), "the exponent of \\*\\* must be an int literal"),
    (body("for i in range(4):", "    pass", "return f.key_norm"), "line 2: a for loop is not allowed"),
    (body("if f.n > 600:", "    pass", "return f.key_norm"), "line 2: an if statement is not allowed"),
    (body("return f.key_norm.exp()"), "line 2: .f.key_norm.exp. is not an operation of the language"),
    (body("return f.__class__"), "f.__class__ is not a feature"),
    (body("return torch.clamp(f.key_norm, min=0.0, max=1.0)"), "torch.clamp takes no keyword arguments"),
    (body("return pool(group_mean(f.attn), f.window)"), "pool: argument must be a number literal"),
    (body("return pool(group_mean(f.attn), 1001)"), r"kernel size must be an int literal in \[1, 257\], got 1001"),
    (body("return f.key_norm * 10000000.0"), "numbers are bounded by 1e\\+06"),
    (body("return f.attn + f.key_norm"), r"cannot combine \(b, h, g, n\) with \(b, h, n\): dims g and h differ"),
    (body("return group_mean(f.key_norm)"), r"group_mean reduces the query heads of \(b, h, g, n\), got \(b, h, n\)"),
    (body("return rank(f.layer) + f.key_norm"), "rank works along the context dim n, got a number"),
    (body("return f.position"), r"score must return scores shaped \(b, h, n\), this returns \(n\)"),
    (body("return y"), "name 'y' is not bound"),
    ("import os\n" + body("return f.key_norm"), "line 1: an import is not allowed at the top level"),
    (body("return f.key_norm", "return f.value_norm"), "line 2: return must be the last statement"),
    ("def score(f, g):\n    return f.key_norm\n", "exactly one plain parameter"),
    ('SELECTION = {"sink": 999}\n' + body("return f.key_norm"), "SELECTION"),
])
def test_what_the_language_cannot_say_is_refused_with_its_line(source, match):
    start = time.perf_counter()
    with pytest.raises(ProgramRefused, match=match):
        build_graph(source, "hostile.py")
    with pytest.raises(StaticCheckError, match=match):  # stage 0 never swallows its own refusal
        check_source(source)
    assert time.perf_counter() - start < 5  # refused by reading, whatever the program would have cost


def test_refusals_name_the_file_and_each_is_a_value_error():
    with pytest.raises(ProgramRefused, match=r"^my.py line 3: "):
        build_graph(body("x = f.key_norm", "x += 1", "return x"), "my.py")
    assert issubclass(ProgramRefused, ValueError) and issubclass(StaticCheckError, ValueError)


def test_broadcast_follows_torch_where_symbols_agree():
    assert ops.broadcast(("b", "h", "n"), ("n",)) == ("b", "h", "n")
    assert ops.broadcast((), ("b", "h", "g", "n")) == ("b", "h", "g", "n")
    with pytest.raises(ops.TypeRefusal):
        ops.broadcast(("b", "h", "g", "n"), ("b", "h", "n"))
