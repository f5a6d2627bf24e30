"""The exported grammar: generated from the operations table, accepting every program kvsieve has kept, and in
its typed form accepting only programs the checker passes (so an LLM decoding under it writes only valid ones): every
budget's worst case over its strings is inside the checker's limits (issue 72: the unbounded typed rule admitted 5
nested ranks, 300 chained additions, 130 nested calls and a 599-operation sum), and its random strings pass stage 1
(finite scores: no division by a feature that can be 0)."""

from __future__ import annotations

import glob
import random
import sqlite3
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from lark import Lark
from llguidance.gbnf_to_lark import gbnf_to_lark

from kvsieve.evolve.seeds import SEEDS
from kvsieve.evolve.stage1_invariants import check_invariants
from kvsieve.language import grammar, operations
from kvsieve.language.cost import REFERENCE_DIMS
from kvsieve.language.interpreter import Limits, budgets, input_elements
from kvsieve.language.program_source import Program
from kvsieve.language.static_check import StaticCheckError, check_source
from kvsieve.language.typed_graph import MAX_DEPTH, MAX_OPERATIONS

ROOT = Path(__file__).resolve().parents[2]
# a typed_program's text up to its expression (what the refusals below are appended to)
HEADER = '"""Evolved policy."""\nSELECTION = {"sink": 0, "chunk_size": 14}\n\ndef score(f):\n    return '


@pytest.fixture(scope="module")
def parsers() -> dict[str, Lark]:
    text = grammar.lark_text()
    return {start: Lark(text, start=start, parser="earley") for start in ("program", "typed_program")}


def _kept_programs() -> list[str]:
    """Every program the evolution databases hold past stage 1, the exported files and the seeds."""
    sources: dict[str, None] = {}
    for path in sorted(glob.glob(str(ROOT / "results" / "evolve" / "**" / "*.sqlite"), recursive=True)):
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            for (source,) in db.execute("SELECT source FROM programs WHERE source IS NOT NULL AND stage >= 1 AND "
                                        "status IN ('ok', 'migrated', 'duplicate', 'proxy_rejected')"):
                sources[source] = None
    for path in sorted((ROOT / "results" / "evolve").rglob("*.py")):
        sources[path.read_text()] = None
    for source in SEEDS.values():
        sources[source] = None
    return list(sources)


def test_the_committed_grammar_files_and_the_language_page_are_the_generated_ones():
    folder = ROOT / "docs" / "grammar"
    assert (folder / "policy.lark").read_text() == grammar.lark_text()
    assert (folder / "policy.gbnf").read_text() == grammar.gbnf_text()
    page = (ROOT / "docs" / "policy-language.md").read_text()
    for line in operations.describe():  # the page lists every operation as the table has it
        assert line in page, line


def test_every_kept_program_is_in_the_language_and_the_grammar(parsers):
    kept = _kept_programs()
    assert len(kept) > 800
    for source in kept:  # the checker (types and costs at 32k) accepts all of them
        check_source(source)
    rng = random.Random(0)  # the Earley parse is slow: every file and seed, and 60 of the databases' programs
    files = [*SEEDS.values(), *(p.read_text() for p in (ROOT / "results" / "evolve").rglob("*.py"))]
    for source in files + rng.sample(kept, 60):
        parsers["program"].parse(source)


def test_every_string_of_the_typed_grammar_passes_stage_0(parsers):
    for seed in range(300):  # the Lark typed_program, the GBNF (the same rules) and the decoding grammar's
        source = grammar.sample(seed)
        check_source(source)
        parsers["typed_program"].parse(source)
        parsers["program"].parse(source)


def test_the_gbnf_and_the_decoding_grammar_as_llguidance_reads_them_accept_every_string_and_no_refused_one(smollm2):
    """The GBNF file is read by llguidance (its own GBNF-to-Lark conversion) and the decoding grammar as the
    constrained mutator compiles it; each accepts the 300 strings (all accepted by stage 0) and refuses issue 72's."""
    tokenizer = smollm2[1]
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer)
    compiled = {"gbnf": llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar.gbnf_text())),
                "decoding": llguidance.LLMatcher.grammar_from_lark(grammar.decoding_lark(fenced=False))}

    def accepts(which: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(lltokenizer, compiled[which])
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    for seed in range(300):
        source = grammar.sample(seed)
        assert accepts("gbnf", source) and accepts("decoding", source), source
    good = HEADER + "rank(group_mean(f.attn))\n"
    assert accepts("gbnf", good) and accepts("decoding", good)  # so that each refusal below is the expression's
    for bad in ("rank(rank(rank(rank(rank(f.key_norm)))))", "(f.key_norm / f.layer)", "(f.key_norm ** 4)", "f.attn",
                "torch.abs(" * 5 + "f.key_norm" + ")" * 5):
        assert not accepts("gbnf", HEADER + bad + "\n") and not accepts("decoding", HEADER + bad + "\n"), bad


def test_the_typed_grammars_worst_case_is_inside_every_budget_of_the_checker():
    """The bounds are read off the rules (each an upper bound: the checker only merges common subexpressions), so no
    string of the exported typed grammars, however a decoder strings its tokens, can be refused by stage 0."""
    bound = grammar.bounds()
    limit = budgets(Limits(), input_elements(REFERENCE_DIMS))
    assert bound.depth == grammar.TYPED_DEPTH == grammar.DECODING_DEPTH
    assert bound.time_ns <= limit.time_ns / 2, (bound.time_ns, limit.time_ns)  # half: room for recalibration
    assert bound.operations <= MAX_OPERATIONS and bound.operations == 3 * (2 ** grammar.TYPED_DEPTH - 1)
    assert bound.nesting <= MAX_DEPTH and bound.parentheses < 100  # Python's parser stops at 200
    assert bound.peak_bytes <= limit.memory_bytes and bound.largest_tensor <= limit.tensor_bytes
    program = check_source(bound.witness)  # the slowest string (but for merging) is accepted
    assert program.check_budgets(dict(REFERENCE_DIMS)).total_ns <= bound.time_ns
    assert grammar.bounds(grammar.TYPED_DEPTH + 2).time_ns > limit.time_ns  # the depth is what bounds it


@pytest.mark.parametrize("expression", [
    "rank(rank(rank(rank(rank(f.key_norm)))))",  # issue 72: over the time budget
    "(" * 299 + "f.key_norm" + " + f.value_norm)" * 299,  # Python's nested-parentheses limit
    "torch.abs(" * 130 + "f.key_norm" + ")" * 130,  # deeper than the checker's 128
    "group_mean(rank(f.attn))", "group_mean(pool(f.attn, 257))",  # rank and pool only once g is reduced
    "(f.key_norm / f.layer)", "(f.key_norm / f.position)", "(f.key_norm ** -1)", "(f.key_norm ** 4)",
])
def test_the_typed_grammar_refuses_what_the_checker_or_finite_scores_would(parsers, expression):
    parsers["typed_program"].parse(HEADER + "rank(group_mean(f.attn))\n")  # the header is the grammar's
    with pytest.raises(Exception):  # noqa: B017 - lark's several error types
        parsers["typed_program"].parse(HEADER + expression + "\n")


def test_a_balanced_sum_of_300_terms_is_refused_by_the_typed_grammar_and_by_the_checker(parsers):
    terms = [f"(f.key_norm * {i + 1})" for i in range(300)]
    while len(terms) > 1:
        terms = [f"({a} + {b})" if b else a for a, b in zip(terms[::2], [*terms[1::2], ""])]
    source = HEADER + terms[0] + "\n"
    with pytest.raises(StaticCheckError, match="operations, more than 256"):
        check_source(source)
    with pytest.raises(Exception):  # noqa: B017
        parsers["typed_program"].parse(source)


def test_the_syntax_rule_bounds_its_literals(parsers):
    header = "def score(f):\n    return f.key_norm * "
    parsers["program"].parse(header + "1234567.12345678e-12\n")
    for literal in ("9" * 401, "1" * 8, "1.5e123", "2 ** 10"):
        with pytest.raises(Exception):  # noqa: B017
            parsers["program"].parse(header + literal + "\n")


def test_the_decoding_grammars_random_strings_pass_stage_1():
    """Issue 72: 64 of 300 derivations of the old decoding grammar failed stage 1 on non-finite scores (a division by
    f.layer, 0 at the first layer); the typed form now divides only by what cannot be 0. Measured: 300 of 300 pass
    (1499 of 1500: exp(exp(x)) pooled over 243 entries overflows)."""
    passed = 0
    for seed in range(300):
        source = grammar.sample(seed, depth=grammar.DECODING_DEPTH)
        _, reason = check_invariants(check_source(source), Program(source), 16, (0, 1))
        passed += not reason
    assert passed >= 285, passed  # >= 95%


def test_the_typed_grammar_refuses_what_would_fail_the_checker(parsers):
    assert parsers["typed_program"].parse(HEADER + "group_mean(f.attn)\n")
    for bad in ("f.attn\n", "(f.attn + f.key_norm)\n", "pool(f.key_norm, 300)\n", "torch.norm(f.key_norm)\n",
                "(f.key_norm / 0)\n", "(f.key_norm ** 9)\n"):
        with pytest.raises(Exception):  # noqa: B017 - lark's several error types
            parsers["typed_program"].parse(HEADER + bad)


def test_every_string_of_the_depth_bounded_decoding_grammar_passes_stage_0():
    decoding = Lark(grammar.decoding_lark(fenced=False), start="start", parser="earley")
    for seed in range(150):
        source = grammar.sample(seed, depth=grammar.DECODING_DEPTH)
        check_source(source)
        decoding.parse(source)
