"""Point, the one parser and formatter of a results row's policy label and the one type
of a policy at a setting: every form round trips, decode labels with an eviction interval parse (the regexes it
replaced did not), references, unregistered families, what a point derives (budget, protects_question), the one
ratio check; and a grep of kvsieve/ for label or policy-name handling as text anywhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvsieve.policies.label import DECODE, FULL_CACHE, PREFILL, Mode, Point
from kvsieve.policies.oracle import Oracle
from kvsieve.policy import FullCache
from kvsieve.risk.losses import candidates_for

ROOT = Path(__file__).resolve().parents[2] / "kvsieve"

FORMS = [
    ("snapkv", Point("snapkv")),
    ("snapkv(window=32)", Point("snapkv(window=32)")),
    ("snapkv@decode128", Point("snapkv", mode=Mode(128))),
    ("tova@decode8e4", Point("tova", mode=Mode(8, 4))),
    ("snapkv+qa", Point("snapkv", question_aware=True)),
    ("oracle(window=16)+qa", Point("oracle(window=16)", question_aware=True)),
    ("learned(checkpoint='a@b')", Point("learned(checkpoint='a@b')")),
    ("learned(checkpoint='a@b')@decode64e2", Point("learned(checkpoint='a@b')", mode=Mode(64, 2))),
    ("program:results/gone/best.py@decode16", Point("program:results/gone/best.py", mode=Mode(16))),
    ("full", Point(FULL_CACHE)),
    ("full@decode128e32", Point(FULL_CACHE, mode=Mode(128, 32))),
]


@pytest.mark.parametrize(("text", "label"), FORMS)
def test_every_form_round_trips(text, label):
    parsed = Point.parse(text)
    assert parsed == label and parsed.display == text and str(parsed) == text + "@0"
    # the store's column and its own flag
    assert Point.parse(parsed.stored, question_aware=parsed.question_aware) == parsed
    assert "+qa" not in parsed.stored


def test_a_decode_label_with_an_eviction_interval_parses():
    # the regexes this replaced (^(.+)@decode([1-9][0-9]*)$ in risk/losses.py, @decode\d+$ in harness/headline.py)
    # read "tova@decode8e4" as a prefill spec named "tova@decode8e4", paired with "full"
    label = Point.parse("tova@decode8e4")
    assert (label.spec, label.chunk_size, label.evict_every, label.mode.name) == ("tova", 8, 4, DECODE)
    assert label.reference == Point(FULL_CACHE, mode=Mode(8, 4)) and label.reference.stored == "full@decode8e4"
    cand = Point.parse("tova@decode8e4", 0.5)
    assert (cand.spec, cand.chunk_size, cand.mode, cand.reference.stored) == ("tova", 8, Mode(8, 4), "full@decode8e4")
    assert Point("tova", 0.5, mode=Mode(8, 4)).stored == "tova@decode8e4"
    assert Point("tova", 0.5, mode=Mode(8)).stored == "tova@decode8"
    assert Point("tova", 0.5).stored == "tova" and Point.parse("tova").mode == Mode()
    assert not Point.parse("tova").mode.is_decode


def test_question_aware_labels_and_references():
    assert Point.parse("snapkv", question_aware=True).display == "snapkv+qa"
    assert Point.parse("snapkv+qa", question_aware=True).display == "snapkv+qa"  # never twice
    assert Point.parse("snapkv+qa").stored == "snapkv"
    assert Point.parse("snapkv+qa").is_reference and not Point.parse("snapkv").is_reference
    assert Oracle.is_reference and Point.parse("oracle").is_reference
    assert Point.parse("oracle(window=16)@decode64").is_reference
    assert not Point.parse("full").is_reference and not Point.parse("full").compresses
    assert Point.parse("snapkv+qa").reference == Point(FULL_CACHE)  # the full cache is never question-aware
    assert Point.parse("snapkv(window=32)@decode128").reference.stored == "full@decode128"


def test_full_cache_and_family():
    assert FULL_CACHE == FullCache.name
    assert Point.parse("full").is_full and Point.parse("full@decode128").is_full
    assert not Point.parse("snapkv").is_full and Point.parse("snapkv").compresses
    assert Point.parse("snapkv(window=32)@decode8").family == "snapkv"
    # a program's label is read without its file (stores keep labels of programs since deleted)
    program = Point.parse("program:results/no/such/file.py@decode16")
    assert program.family == "program" and program.compresses and not program.is_reference
    assert candidates_for(["full", "full@decode128", "tova@decode8e4", "snapkv+qa"], [0.5]) == [
        Point.parse("tova@decode8e4", 0.5), Point("snapkv", 0.5)]


def test_an_unregistered_family_reads_as_an_ordinary_compressing_policy():
    """Rows of a family this kvsieve no longer registers still draw: an ordinary line, never a reference."""
    label = Point.parse("gone_family(x=1)@decode64")
    assert (label.family, label.family_class) == ("gone_family", None)
    assert label.compresses and not label.is_reference and not label.is_full
    assert label.reference.stored == "full@decode64" and label.display == "gone_family(x=1)@decode64"
    assert Point.parse("oracle_attention").family_class is None and not Point.parse("oracle_attention").is_reference
    assert Point.parse("gone_family+qa").is_reference  # question-aware: a reference whatever the family


@pytest.mark.parametrize("text", ["snapkv@decode0", "snapkv@decode", "snapkv@decode8e0", "snapkv@decodeX",
                                  "snapkv@decode8e", "+qa", "", "@decode8"])
def test_malformed_labels_are_refused(text):
    with pytest.raises(ValueError):
        Point.parse(text)


def test_a_label_refuses_what_no_row_stores():
    with pytest.raises(ValueError, match="chunk_size"):
        Mode(evict_every=4)  # an eviction interval without decode-time eviction
    with pytest.raises(ValueError, match="question_aware=True"):
        Point("snapkv+qa")  # the display suffix: parse the whole label instead
    with pytest.raises(ValueError, match="give it once"):
        Point("snapkv@decode8", 0.5, mode=Mode(16))
    assert Point("snapkv@decode8", 0.5) == Point("snapkv", 0.5, mode=Mode(8))  # a stored label names its mode
    with pytest.raises(ValueError):
        Mode(chunk_size=-1)
    with pytest.raises(ValueError, match="mode is a Mode"):
        Point("snapkv", 0.5, mode="decode")


@pytest.mark.parametrize("spec", ["snapkv(window=", "snapkv(window=32", "snapkv(32)", "program:", "snapkv(w=x)"])
def test_a_point_refuses_a_spec_no_parser_reads(spec):
    """The spec's syntax is checked when the point is made (text only: no file is opened), so a contract or a grid
    holding one fails when read, naming the policy."""
    with pytest.raises(ValueError, match=re.escape(f"policy {spec!r} is not a policy spec")):
        Point(spec, 0.5)


def test_the_engine_is_given_the_mode_as_the_label_names_it():
    """What attach and generate get (harness/evaluate and risk/runtime both read it): the label's chunk and its
    interval, 1 unless the label says eN, never the engine's own default interval."""
    assert Point.parse("snapkv@decode16", 0.5).mode.engine_options == {"mode": "decode", "chunk_size": 16,
                                                                        "evict_every": 1}
    assert Mode(8, 4).engine_options == {"mode": "decode", "chunk_size": 8, "evict_every": 4}
    assert Mode().engine_options == {} and Point("snapkv", 0.5, True).mode.engine_options == {}


def test_no_point_is_question_aware_and_decode_time():
    """A decode-time point reads the question under eviction: there is no question-aware one to make (the grid, the
    certifier and a contract all read points, so none of them can hold one)."""
    for make in (lambda: Point("snapkv", 0.5, True, Mode(64)), lambda: Point.parse("snapkv@decode64+qa", 0.5),
                 lambda: candidates_for(["snapkv@decode64"], [0.5], question_aware=True)):
        with pytest.raises(ValueError, match="question is read under eviction anyway"):
            make()


@pytest.mark.parametrize("ratio", [1.0, -0.1, float("nan"), float("inf"), True, "0.5", None])
def test_the_ratio_is_checked_once_when_a_point_is_made(ratio):
    with pytest.raises(ValueError, match=r"policy 'snapkv' has ratio .*; a compression ratio is in \[0, 1\)"):
        Point("snapkv", ratio)


def test_what_a_point_derives_once():
    """budget: Budget(ratio) where something is evicted; protects_question: a question-aware prefill point that
    evicts (decode-time eviction reads the question under eviction anyway); stored text as the store keeps it."""
    from kvsieve.selection import Budget

    qa = Point("snapkv", 0.5, True)
    assert qa.budget == Budget(ratio=0.5) and qa.protects_question
    assert Point("snapkv", 0.0, True).budget is None and not Point("snapkv", 0.0, True).protects_question
    assert Point("full", 0.0).budget is None and Point(FULL_CACHE).reference == Point(FULL_CACHE)
    decode = Point.parse("snapkv@decode64", 0.75)
    assert decode.budget == Budget(ratio=0.75) and not decode.protects_question
    assert not Point("snapkv", 0.5).protects_question
    assert qa.as_dict() == {"policy": "snapkv", "ratio": 0.5, "question_aware": True, "chunk_size": 0,
                            "evict_every": 1}
    assert decode.at(0.25) == Point.parse("snapkv@decode64", 0.25) and str(decode.at(0.25)) == "snapkv@decode64@0.25"
    assert Mode(64).is_decode and Mode(64).name == DECODE and Mode().name == PREFILL and Mode(64) != Mode(32)
    assert Mode(64) != DECODE and Mode() != PREFILL  # a mode is a type, never equal to a string
    # ordered as candidates always were: by stored label, then ratio, then question-awareness
    assert sorted([Point("tova", 0.5), Point("snapkv", 0.75, True), Point("snapkv", 0.75), Point("snapkv", 0.5)]) == [
        Point("snapkv", 0.5), Point("snapkv", 0.75), Point("snapkv", 0.75, True), Point("tova", 0.5)]


# -- nobody else handles labels or policy names as text ---------------------------------------------------------

# what reads a policy label, a policy or family name, or a mode of a label as text
FORBIDDEN = {
    "compares to 'full'": re.compile(r"""[=!]=\s*["']full["']|["']full["']\s*[=!]=|\{\s*["']full["']\s*\}"""),
    "builds or matches full@": re.compile(r"""["']full@"""),
    "builds or matches @decode": re.compile(r"""@decode(\{|\\d|\(|\[)"""),
    "tests an oracle prefix": re.compile(r"""startswith\(\s*\(?\s*["']oracle"""),
    "handles +qa as text": re.compile(r"""(endswith|removesuffix|startswith)\(\s*["']\+qa|'\+qa'|"\+qa\""""),
    "tests a name as a substring": re.compile(r"""["'](kvzap|learned|program|oracle|full)["']\s+in\s"""),
    "tests a family by its spec's prefix": re.compile(r"""startswith\(\s*\(?\s*["'](program:|learned\(|kvzap\()"""),
}
# "full" that names no policy: the sandbox's isolation level and the reconstruction's normalization
NOT_A_POLICY = {"evolve/sandbox.py": "isolation level", "engine/reconstruct.py": "normalization",
                "policies/kvzip.py": "normalization"}
PARSER = "policies/label.py"


def offending_lines() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name == PARSER:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line) and not (what == "compares to 'full'" and name in NOT_A_POLICY):
                    found.append(f"{name}:{number}: {what}: {line.strip()}")
    return found


def test_only_the_label_module_reads_labels_and_policy_names_as_text():
    found = offending_lines()
    assert not found, "use kvsieve.policies.label.Point instead:\n" + "\n".join(found)


def test_the_grep_finds_what_it_forbids(tmp_path, monkeypatch):
    """The patterns catch the code they replaced (a grep that matches nothing proves nothing)."""
    old = ['if split_label(p)[0] != "full":', 'return f"full@decode{self.chunk_size}"',
           '_DECODE = re.compile(r"@decode\\d+$")', 'return f"{self.policy}@decode{self.chunk_size}"',
           'return name.startswith("oracle") or name.endswith("+qa")', 'label.removesuffix("+qa")',
           'kind = "kvzap" if "kvzap" in (config.objective, config.network) else "learned"',
           'found = sorted(p for p in s if p.startswith(("program:", "learned(", "kvzap(")))',
           'sorted(set(from_store) - set(found) - {"full"})']
    for line in old:
        assert any(p.search(line) for p in FORBIDDEN.values()), line
    root = tmp_path / "kvsieve"
    (root / "engine").mkdir(parents=True)
    (root / "engine" / "reconstruct.py").write_text('if normalization == "full":\n')
    (root / "x.py").write_text('if normalization == "full":\n')
    monkeypatch.setitem(globals(), "ROOT", root)
    assert offending_lines() == ["x.py:1: compares to 'full': if normalization == \"full\":"]


def test_one_order_of_labels_for_every_table_and_legend():
    """display_order (report's columns, legends, the headline's listing): full cache first, then ordinary policies,
    then reference ones (a reference family, question-aware rows), each group alphabetical; duplicates once."""
    from kvsieve.policies.label import display_order

    names = ["snapkv", "oracle", "tova+qa", "full@decode64", "knorm", "full", "snapkv", "unregistered_family"]
    assert display_order(map(Point.parse, names)) == ["full", "full@decode64", "knorm", "snapkv", "unregistered_family",
                                                      "oracle", "tova+qa"]
    assert Point.parse("oracle").sort_key == (True, True, "oracle")
