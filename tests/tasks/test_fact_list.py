"""The long-output task (fact_list): its layout, its fit to a length, determinism, the answer's length, the
metric on hand-written predictions, and its registration with the loaders."""

import re

import pytest

from kvsieve.harness.grid import GridConfig
from kvsieve.harness.validate import validate
from kvsieve.tasks import fact_list
from kvsieve.tasks.load import ALL_TASKS, generator_for
from kvsieve.tasks.metrics import score


def words(text: str) -> int:
    """A stand-in tokenizer: whitespace-separated pieces."""
    return len(text.split())


LENGTH, OVERHEAD = 900, 40
RECORD = re.compile(r"Record (\d+) is (\d{7})\.")


@pytest.fixture(scope="module")
def sample():
    return fact_list.generate("fact_list", LENGTH, 7, words, OVERHEAD)


def test_twenty_four_records_in_order_each_once_in_its_span(sample):
    found = RECORD.findall(sample.context)
    assert [int(i) for i, _ in found] == list(range(1, 25))  # 24 records, numbered in order, nothing else
    values = [v for _, v in found]
    assert sample.answers == values and len(set(values)) == 24
    assert [sample.context[a:b] for a, b in sample.spans] == [f"Record {i} is {v}." for i, v in found]
    assert [a for a, _ in sample.spans] == sorted(a for a, _ in sample.spans)
    assert sample.metric == "string_match_all" and sample.answer_prefix == "Record 1 is"
    assert sample.id == "fact_list-900-7" and sample.task == "fact_list" and sample.length == LENGTH


def test_records_are_spread_through_the_haystack(sample):
    # record i (0-based) sits in the i-th of 24 equal slices of the haystack's sentences: count the prose
    # sentences (each ends with '.' or '?') before it, outside the head and the records
    body = sample.context.split("\n", 1)[1]
    pieces = RECORD.split(body)
    prose = [p for k, p in enumerate(pieces) if k % 3 == 0]  # split keeps the 2 groups between the prose parts
    before = [0]
    for part in prose[:-1]:
        before.append(before[-1] + len(re.findall(r"[.?]( |$)", part.strip() + " ")))
    total = before[-1] + len(re.findall(r"[.?]( |$)", prose[-1].strip() + " "))
    assert total > 48  # a haystack around the records, not records alone
    for i in range(24):
        assert i / 24 - 1 / total <= before[i + 1] / total <= (i + 1) / 24 + 1 / total


def test_fills_the_length_and_sizes_the_answer(sample):
    assert LENGTH - 25 <= words(sample.context) + OVERHEAD <= LENGTH
    # the reference listing: 24 lines "Record i is VALUE." of 4 words each, plus the slack of 24
    assert sample.max_new_tokens == 24 * 4 + 24
    listing = fact_list.reference_listing(sample.answers)
    assert listing.split("\n")[4] == f"Record 5 is {sample.answers[4]}."


def test_deterministic_by_seed():
    a = fact_list.generate("fact_list", 600, 3, words, 10)
    b = fact_list.generate("fact_list", 600, 3, words, 10)
    c = fact_list.generate("fact_list", 600, 4, words, 10)
    assert a == b
    assert a.answers != c.answers and a.context != c.context
    # the records do not depend on the length: a longer context holds the same facts
    assert fact_list.generate("fact_list", 1200, 3, words, 10).answers == a.answers


def test_metric_is_the_fraction_of_values_recalled(sample):
    values = sample.answers
    perfect = fact_list.reference_listing(values)
    assert score(sample.metric, perfect, values) == 100.0
    six = "\n".join(f"Record {i + 1} is {values[i]}." for i in (0, 3, 5, 10, 17, 23))
    assert score(sample.metric, six, values) == pytest.approx(100 * 6 / 24)  # 25.0
    # order is not scored, a value cut short is not recalled, a made-up number recalls nothing
    shuffled = " ".join(reversed(values[:12])) + " " + values[12][:6]
    assert score(sample.metric, shuffled, values) == pytest.approx(100 * 12 / 24)
    assert score(sample.metric, "Record 1 is 1234567.", values) == (100 / 24 if "1234567" in values else 0.0)


def test_errors():
    with pytest.raises(ValueError, match="unknown long-output task 'niah_single_1'; allowed: fact_list"):
        fact_list.generate("niah_single_1", LENGTH, 0, words)
    with pytest.raises(ValueError, match="length must be a positive integer, got 0"):
        fact_list.generate("fact_list", 0, 0, words)
    with pytest.raises(ValueError, match="length 100 is too small for task 'fact_list'"):
        fact_list.generate("fact_list", 100, 0, words)


def test_registered_with_the_loaders():
    assert "fact_list" in ALL_TASKS
    assert generator_for("fact_list") is fact_list.generate
    validate(GridConfig(model="smollm2-135m-instruct", tasks=["fact_list"], lengths=[1024], policies=["full"],
                        ratios=[0.5]))
