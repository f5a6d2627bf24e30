"""The second RULER layout (fmt2): its format, its fit to a length, determinism, errors."""

import re

import pytest

from kvsieve.tasks import ruler, ruler_alt
from kvsieve.tasks.metrics import score


def words(text: str) -> int:
    """A stand-in tokenizer: whitespace-separated pieces (newlines count as separators)."""
    return len(text.split())


LENGTH, OVERHEAD = 600, 40
HEADS = {"fmt2:niah_single_1": "A special magic number is", "fmt2:niah_single_2": "A special magic number is",
         "fmt2:niah_single_3": "A special magic uuid is", "fmt2:niah_multikey_1": "4 special magic numbers are",
         "fmt2:niah_multikey_2": "Many special magic numbers are", "fmt2:niah_multikey_3": "Many special magic uuids",
         "fmt2:niah_multivalue": "4 special magic numbers are", "fmt2:niah_multiquery": "4 special magic numbers are"}


@pytest.fixture(scope="module", params=ruler_alt.TASKS)
def sample(request):
    return ruler_alt.generate(request.param, LENGTH, 3, words, OVERHEAD)


def test_names_and_base_tasks():
    assert ruler_alt.TASKS[0] == "fmt2:niah_single_1" and len(ruler_alt.TASKS) == 9
    assert all(ruler_alt.base_task(t) in ruler.TASKS for t in ruler_alt.TASKS)
    assert ruler_alt.is_alt_task("fmt2:vt") and not ruler_alt.is_alt_task("vt")
    with pytest.raises(ValueError, match=r"unknown fmt2 task 'fmt2:cwe'.*fmt2:niah_single_1"):
        ruler_alt.generate("fmt2:cwe", LENGTH, 0, words)
    with pytest.raises(ValueError, match="unknown fmt2 task 'niah_single_1'"):
        ruler_alt.generate("niah_single_1", LENGTH, 0, words)
    with pytest.raises(ValueError, match="length must be a positive integer, got 0"):
        ruler_alt.generate("fmt2:vt", 0, 0, words)
    with pytest.raises(ValueError, match="length 20 is too small"):
        ruler_alt.generate("fmt2:niah_single_1", 20, 0, words)


def test_layout_differs_from_the_first_generator_as_documented(sample):
    lines = sample.context.split("\n")
    assert sample.context.endswith("\n") and lines[-1] == ""  # the context ends with a newline
    assert sample.answer_prefix.startswith(" ") and not sample.answer_prefix.startswith("  ")
    if "niah" in sample.task:
        assert lines[0].startswith(HEADS[sample.task]) and "hidden within the following text" in lines[0]
    # every relevant item is one whole line, and every line is one haystack unit or one item
    for a, b in sample.spans:
        assert sample.context[a - 1] == "\n" and sample.context[b] == "\n"
        assert sample.context[a:b] in lines
    body = lines[1:-1]
    assert all(line and line == line.strip() and line[0].isupper() for line in body)
    assert all(line.count("One of the special magic") <= 1 for line in body)


def test_answers_are_in_the_relevant_lines_once(sample):
    relevant = " ".join(sample.context[a:b] for a, b in sample.spans)
    for answer in sample.answers:
        assert answer in relevant
        assert sample.context.count(answer) == 1 or sample.task == "fmt2:vt"  # vt names recur in the chain
    # the answers pass the task's metric; the instruction alone does not
    assert score(sample.metric, " ".join(sample.answers), sample.answers) == 100.0
    assert score(sample.metric, lines_without_items(sample), sample.answers) < 100.0


def lines_without_items(sample) -> str:
    text = sample.context
    for a, b in sorted(sample.spans, reverse=True):
        text = text[:a] + text[b:]
    return text


def test_context_fills_the_length_and_not_more(sample):
    used = words(sample.context) + OVERHEAD
    assert LENGTH - 25 < used <= LENGTH  # one more haystack line (at most ~20 words) would not fit


def test_items_sit_at_their_depths_and_in_order():
    s = ruler_alt.generate("fmt2:vt", 2000, 5, words, 0)
    lines = s.context.split("\n")[1:-1]
    chain = [i for i, line in enumerate(lines) if line.startswith("VAR ")]
    assert len(chain) == 5 and chain == sorted(chain)
    names = [re.match(r"VAR (\w+) =", lines[i]).group(1) for i in chain]
    assert names == s.answers  # read top to bottom, each assignment names the previous variable
    assert all(f"VAR {names[i - 1]}." in lines[chain[i]] for i in range(1, 5))
    # the depths are spread: not all items at one end of a ~200-line haystack
    assert chain[-1] - chain[0] > 10


def test_deterministic_per_seed_and_different_across_seeds():
    a = ruler_alt.generate("fmt2:niah_single_2", LENGTH, 7, words, OVERHEAD)
    b = ruler_alt.generate("fmt2:niah_single_2", LENGTH, 7, words, OVERHEAD)
    c = ruler_alt.generate("fmt2:niah_single_2", LENGTH, 8, words, OVERHEAD)
    assert a == b and a.id == "fmt2:niah_single_2-600-7" and a.task == "fmt2:niah_single_2"
    assert c.answers != a.answers and c.context != a.context


def test_prose_differs_from_the_first_generators_prose():
    alt = ruler_alt.generate("fmt2:niah_single_2", LENGTH, 0, words, OVERHEAD).context
    first = ruler.generate("niah_single_2", LENGTH, 0, words, OVERHEAD).context
    alt_lines = set(alt.split("\n"))
    assert not alt_lines & set(re.split(r"(?<=[.?!]) ", first))  # no sentence in common


def test_items_go_before_the_line_at_their_depth_keeping_their_order():
    layout = ruler_alt._Layout("H\n", [(0.5, "X1", True), (0.5, "X2", False), (0.0, "X0", True), (1.0, "X3", True)],
                               lambda n: [f"u{i}" for i in range(n)], "q", " p", ["X1"], 8)
    text, spans = ruler_alt._lines(layout, 4)
    assert text == "H\nX0\nu0\nu1\nX1\nX2\nu2\nu3\nX3\n"
    assert [text[a:b] for a, b in spans] == ["X0", "X1", "X3"]
