"""The exported grammar: generated from the operations table, accepting every program kvsieve has kept, and in
its typed form accepting only programs the checker passes (so an LLM decoding under it writes only valid ones)."""

from __future__ import annotations

import glob
import random
import sqlite3
from pathlib import Path

import pytest
from lark import Lark

from kvsieve.evolve.seeds import SEEDS
from kvsieve.language import grammar, operations
from kvsieve.language.static_check import check_source

ROOT = Path(__file__).resolve().parents[2]


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
    for seed in range(300):
        source = grammar.sample(seed)
        check_source(source)
        parsers["typed_program"].parse(source)
        parsers["program"].parse(source)


def test_the_typed_grammar_refuses_what_would_fail_the_checker(parsers):
    header = '"""Evolved policy."""\nSELECTION = {"chunk_size": 4, "sink": 0}\n\ndef score(f):\n    return '
    assert parsers["typed_program"].parse(header + "group_mean(f.attn)\n")
    for bad in ("f.attn\n", "(f.attn + f.key_norm)\n", "pool(f.key_norm, 300)\n", "torch.norm(f.key_norm)\n",
                "(f.key_norm / 0)\n", "(f.key_norm ** 9)\n"):
        with pytest.raises(Exception):  # noqa: B017 - lark's several error types
            parsers["typed_program"].parse(header + bad)


def test_every_string_of_the_depth_bounded_decoding_grammar_passes_stage_0():
    decoding = Lark(grammar.decoding_lark(fenced=False), start="start", parser="earley")
    for seed in range(150):
        source = grammar.sample(seed, max_depth=99, depth=grammar.DECODING_DEPTH)
        check_source(source)
        decoding.parse(source)
