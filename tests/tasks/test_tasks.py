"""RULER generators, Sample JSONL storage and the LongBench loader (no model needed)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from kvsieve.tasks import TASKS, Sample, generate, generate_many, load_longbench, read_jsonl, write_jsonl
from kvsieve.tasks.haystack import NOISE, ProseStream, noise_units, prose
from kvsieve.tasks.metrics import METRICS, score
from kvsieve.tasks.ruler import fit_units

FIXTURES = Path(__file__).parent / "fixtures"


def words(s: str) -> int:
    return len(s.split())


def chars4(s: str) -> int:  # a second, different "tokenizer"
    return (len(s) + 3) // 4


LOCATED = [t for t in TASKS if t not in ("cwe", "fwe")]  # tasks whose answers sit in recorded spans


# ------------------------------------------------------------------------------------------- generators


def test_task_list():
    assert len(TASKS) == 13 and len(set(TASKS)) == 13
    assert {"niah_single_1", "niah_multikey_3", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"} <= set(TASKS)


@pytest.mark.parametrize("task", TASKS)
def test_generate_is_deterministic_and_fits(task):
    a = generate(task, 1500, 7, words, template_overhead=40)
    b = generate(task, 1500, 7, words, template_overhead=40)
    assert a.to_dict() == b.to_dict()
    used = words(a.context) + 40
    assert used <= 1500
    assert used >= 1500 - 120, f"{task}: only {used} of 1500 tokens used"
    assert a.task == task and a.length == 1500 and a.seed == 7
    assert a.metric in METRICS
    assert a.answers and all(isinstance(x, str) and x for x in a.answers)
    assert a.max_new_tokens > 0
    assert a.question and a.question not in a.context
    assert a.answer_prefix not in a.context


@pytest.mark.parametrize("task", TASKS)
def test_other_tokenizer_and_length(task):
    s = generate(task, 3000, 1, chars4, template_overhead=25)
    used = chars4(s.context) + 25
    assert 3000 * 0.9 <= used <= 3000


@pytest.mark.parametrize("task", TASKS)
def test_distinct_seeds_differ(task):
    a = generate(task, 800, 0, words)
    b = generate(task, 800, 1, words)
    assert a.context != b.context
    assert a.answers != b.answers
    assert a.id != b.id


@pytest.mark.parametrize("task", LOCATED)
def test_answers_in_spans(task):
    for seed in range(3):
        s = generate(task, 1200, seed, words)
        assert s.spans, task
        texts = s.span_texts()
        for ans in s.answers:
            assert ans in s.context
            assert any(ans in t for t in texts), (task, ans)
            # the answer appears nowhere outside the relevant spans
            outside = s.context
            for start, end in sorted(s.spans, reverse=True):
                outside = outside[:start] + "\0" + outside[end:]
            assert ans not in outside, (task, ans)


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")])
def test_niah_needles(task):
    s = generate(task, 1000, 3, words)
    needle = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
    for text in s.span_texts():
        m = needle.fullmatch(text)
        assert m, text
        assert m.group(2) in s.question and m.group(3) in s.answers
    n_values = {"niah_multivalue": 4, "niah_multiquery": 4}.get(task, 1)
    assert len(s.answers) == n_values == len(s.spans)
    if task == "niah_multikey_1":
        assert len(needle.findall(s.context)) == 4  # one queried needle, three distractors
    if task in ("niah_multikey_2", "niah_multikey_3"):
        assert len(needle.findall(s.context)) > 10  # the haystack is made of needles
    if task in ("niah_single_1", "niah_multikey_1"):
        assert "The grass is green." in s.context
    if task in ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_2"):
        assert all(re.fullmatch(r"\d{7}", a) for a in s.answers)
    if task in ("niah_single_3", "niah_multikey_3"):
        assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", a) for a in s.answers)
    assert s.metric == "string_match_all"
    assert score(s.metric, " ".join(s.answers), s.answers) == 100.0


def test_needle_depth_varies_with_seed():
    starts = {generate("niah_single_2", 2000, seed, words).spans[0][0] for seed in range(8)}
    assert len(starts) > 4


def test_vt_chain():
    s = generate("vt", 1000, 2, words)
    assert len(s.answers) == 5 and len(s.spans) == 5
    stmts = s.span_texts()
    value = re.fullmatch(r"VAR (\w+) = (\d+)\.", stmts[0]).group(2)
    assert value in s.question and value in s.answer_prefix
    for prev, cur in zip(stmts, stmts[1:], strict=False):
        m = re.fullmatch(r"VAR (\w+) = VAR (\w+)\.", cur)
        assert m and m.group(2) == re.match(r"VAR (\w+)", prev).group(1)
    assert [re.match(r"VAR (\w+)", t).group(1) for t in stmts] == s.answers
    assert NOISE.split(". ")[0] in s.context


def test_cwe_common_words_are_most_common():
    for length in (600, 3000):
        s = generate("cwe", length, 4, words)
        entries = re.findall(r"\d+\. (\w+)", s.context)
        counts = Counter(entries).most_common()
        top = {w for w, _ in counts[:10]}
        assert top == set(s.answers)
        assert counts[9][1] > counts[10][1]
        assert s.max_new_tokens >= 100 and s.spans == []


def test_fwe_top_three():
    s = generate("fwe", 1500, 4, words)
    body = s.context.split("\n", 1)[1]
    counts = Counter(body.split()).most_common()
    assert [w for w, _ in counts[:3]] == s.answers
    assert counts[2][1] > counts[3][1]


def test_qa_documents():
    s1 = generate("qa_1", 1500, 5, words)
    assert len(s1.spans) == 1 and s1.metric == "string_match_part"
    assert s1.span_texts()[0].startswith("Document ")
    assert len(re.findall(r"^Document \d+:", s1.context, flags=re.M)) > 5  # distractor documents
    s2 = generate("qa_2", 1500, 5, words)
    assert len(s2.spans) == 2
    a, b = s2.span_texts()
    # two hops: the bridge entity links the two gold documents, the answer is in only one of them
    (ans,) = s2.answers
    assert (ans in a) != (ans in b)
    assert score("string_match_part", f"It is {ans}.", s2.answers) == 100.0


def test_errors():
    with pytest.raises(ValueError, match="niah_single_1"):
        generate("niah_single_9", 1000, 0, words)
    for task in TASKS:
        with pytest.raises(ValueError, match=r"\b12\b"):
            generate(task, 12, 0, words)
    with pytest.raises(ValueError, match="1000"):
        generate("niah_single_1", 1000, 0, words, template_overhead=999)
    with pytest.raises(ValueError, match="length"):
        generate("vt", 0, 0, words)
    with pytest.raises(ValueError, match="allowed"):
        list(generate_many(["vt", "nope"], 1000, 2, 0, words))


def test_generate_many():
    overhead = {"niah_single_1": 5, "vt": 7}
    out = list(generate_many(["niah_single_1", "vt"], 500, 3, 10, words, template_overhead=overhead))
    assert [(s.task, s.seed) for s in out] == [(t, seed) for t in ("niah_single_1", "vt") for seed in (10, 11, 12)]
    assert out[0].to_dict() == generate("niah_single_1", 500, 10, words, 5).to_dict()
    assert len(list(generate_many("fwe", 500, 2, 0, words))) == 2


def test_long_context_scales():
    s = generate("niah_multikey_2", 40_000, 0, words, template_overhead=100)
    assert 39_000 <= words(s.context) + 100 <= 40_000
    s = generate("qa_2", 20_000, 0, words)
    assert 19_500 <= words(s.context) <= 20_000


def test_fit_units():
    assert fit_units(lambda n: "x " * n, 100, words) == 100
    assert fit_units(lambda n: "x " * n, 100, words, template_overhead=30) == 70
    assert fit_units(lambda n: "x " * (3 * n + 5), 100, words) == 31
    assert fit_units(lambda n: "x " * n, 100, words, max_units=40) == 40
    with pytest.raises(ValueError, match="grow"):
        fit_units(lambda n: "x", 100, words)
    with pytest.raises(ValueError, match="length 3"):
        fit_units(lambda n: "a b c d", 3, words)


# -------------------------------------------------------------------------------------------- haystack


def test_haystack():
    assert prose(20, 1) == prose(20, 1)
    assert prose(20, 1) != prose(20, 2)
    stream = ProseStream(3)
    assert stream.sentences(5) == ProseStream(3).sentences(50)[:5]
    assert stream.sentence(7) == ProseStream(3).sentences(8)[7]
    text = prose(200, 0)
    assert len(set(text.split())) > 300  # varied, not a repeated paragraph
    assert " ".join(noise_units(5)) == NOISE


# ---------------------------------------------------------------------------------------------- Sample


def _sample(**kw) -> Sample:
    base = dict(
        id="x-1",
        task="demo",
        context="alpha beta gamma",
        question="What?",
        answer_prefix="Answer:",
        answers=["beta"],
        max_new_tokens=8,
        length=3,
        seed=0,
        metric="string_match_all",
        spans=[(6, 10)],
        stop=["\n"],
    )
    base.update(kw)
    return Sample(**base)


def test_sample_round_trip(tmp_path):
    samples = [_sample(), generate("qa_2", 600, 1, words), generate("niah_multivalue", 600, 1, words)]
    path = tmp_path / "runs" / "s.jsonl"  # a folder nothing made yet (the README's export writes into runs/)
    assert write_jsonl(samples, path) == 3
    back = read_jsonl(path)
    assert [s.to_dict() for s in back] == [s.to_dict() for s in samples]
    assert back[0] == samples[0]
    assert back[0].spans == [(6, 10)] and back[0].span_texts() == ["beta"]
    d = json.loads(path.read_text().splitlines()[0])
    assert d["spans"] == [[6, 10]]


def test_sample_validation(tmp_path):
    d = _sample().to_dict()
    del d["answers"]
    with pytest.raises(ValueError, match="answers"):
        Sample.from_dict(d)
    d = _sample().to_dict()
    d["max_new_tokens"] = "8"
    with pytest.raises(ValueError, match="max_new_tokens"):
        Sample.from_dict(d)
    d = _sample().to_dict()
    d["spans"] = [[1]]
    with pytest.raises(ValueError, match="spans"):
        Sample.from_dict(d)
    d = _sample().to_dict()
    d.pop("spans")
    d.pop("stop")
    d["extra"] = 1
    assert Sample.from_dict(d).spans == []
    with pytest.raises(ValueError, match="span"):
        _sample(spans=[(0, 99)])
    with pytest.raises(ValueError, match="answers"):
        _sample(answers="beta")
    with pytest.raises(ValueError, match="object"):
        Sample.from_dict([1, 2])

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_sample().to_dict()) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r":3: invalid JSON"):
        read_jsonl(path)
    bad = _sample().to_dict()
    del bad["metric"]
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r":1: .*metric"):
        read_jsonl(path)


# ------------------------------------------------------------------------------------------- LongBench


def test_longbench_fixtures():
    hot = load_longbench(FIXTURES / "longbench_hotpotqa.jsonl")
    assert len(hot) == 2
    s = hot[1]
    assert s.id == "hp-0002" and s.task == "hotpotqa" and s.metric == "qa_f1" and s.max_new_tokens == 32
    assert s.answers == ["Ada Lind", "Ada M. Lind"]
    assert s.question.endswith("Who designed the lighthouse at Cape Morrow?")
    assert s.context.startswith("Passage 1:") and "Who designed" not in s.context
    assert s.length == 22 and s.spans == []
    assert score(s.metric, "Ada Lind", s.answers) == 100.0

    (pc,) = load_longbench(FIXTURES / "longbench_passage_count.jsonl")
    assert pc.metric == "count" and pc.answers == ["2"] and pc.max_new_tokens == 32 and pc.question

    lcc = load_longbench(FIXTURES / "longbench_lcc.jsonl")
    assert [x.task for x in lcc] == ["lcc", "lcc"]  # lcc_e maps to lcc
    assert all(x.metric == "code_sim" and x.max_new_tokens == 64 for x in lcc)
    assert score("code_sim", "    return a + b\n", lcc[0].answers) == 100.0


def test_longbench_errors(tmp_path):
    good = json.loads((FIXTURES / "longbench_hotpotqa.jsonl").read_text().splitlines()[0])
    path = tmp_path / "lb.jsonl"

    missing = dict(good)
    del missing["context"]
    path.write_text(json.dumps(good) + "\n" + json.dumps(missing) + "\n")
    with pytest.raises(ValueError, match=r"lb\.jsonl:2: missing LongBench field\(s\): context"):
        load_longbench(path)

    path.write_text("{oops\n")
    with pytest.raises(ValueError, match=r":1: invalid JSON"):
        load_longbench(path)

    path.write_text(json.dumps(dict(good, dataset="dureader")) + "\n")
    with pytest.raises(ValueError, match="unsupported dataset 'dureader'"):
        load_longbench(path)

    path.write_text(json.dumps(dict(good, answers=[])) + "\n")
    with pytest.raises(ValueError, match="answers"):
        load_longbench(path)


# the same before and after the shared drawing (checked on 84 samples of both layouts)
PINNED_NEEDLES = "700be282e643252ca82232aabc8fc8296cad43f36fb7828c1b1edfc8c75bff2c"


def test_needle_samples_of_both_layouts_are_pinned():
    """The NIAH samples of both layouts, byte for byte, as they were before the layouts shared their key and value
    drawing (ruler.draw_needles, issue 52): stored rows name samples by (task, length, seed), so their text must
    not move. sha256 over context, question, answer prefix, answers, spans and max_new_tokens."""
    import hashlib

    from kvsieve.tasks import ruler, ruler_alt

    digest = hashlib.sha256()
    for module in (ruler, ruler_alt):
        for task in [t for t in module.TASKS if "niah" in t]:
            for length, seed in ((600, 0), (600, 1), (3000, 2)):
                s = module.generate(task, length, seed, lambda text: len(text) // 4)
                digest.update(json.dumps([s.context, s.question, s.answer_prefix, s.answers, s.spans,
                                          s.max_new_tokens]).encode())
    assert digest.hexdigest() == PINNED_NEEDLES
