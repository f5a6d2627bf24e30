"""Metrics on small hand-computed cases."""

from __future__ import annotations

import pytest

from kvsieve.tasks.metrics import (
    METRICS,
    classification,
    code_sim,
    count,
    edit_similarity,
    levenshtein,
    normalize_answer,
    qa_f1,
    retrieval,
    rouge_l,
    score,
    settled,
    string_match_all,
    string_match_part,
)


def test_string_match():
    assert string_match_all("The numbers are 1234 and 5678.", ["1234", "5678", "9999"]) == pytest.approx(200 / 3)
    assert string_match_all("ABC", ["abc"]) == 100.0
    assert string_match_part("The numbers are 1234 and 5678.", ["1234", "9999"]) == 100.0
    assert string_match_part("nothing", ["1234", "9999"]) == 0.0
    with pytest.raises(ValueError, match="at least one"):
        string_match_all("x", [])


def test_settled_means_no_longer_prediction_can_change_the_score():
    text = "1. 4711\n2. 2024\n3. 4711\n4. 99 and more text after the answers"
    refs = ["4711", "2024", "99"]
    for metric in ("string_match_all", "string_match_part"):
        prefix_scores = [score(metric, text[:i], refs) for i in range(len(text) + 1)]
        assert prefix_scores == sorted(prefix_scores)  # monotone: a reference found stays found
        first = next(i for i, v in enumerate(prefix_scores) if v == 100.0)
        assert [settled(metric, text[:i], refs) for i in range(len(text) + 1)] == [i >= first for i in
                                                                                   range(len(text) + 1)]
    assert not settled("string_match_all", "4711 and 2024", refs)  # 67: "99" may still come
    # F1 is not monotone (more words can lower it), so a perfect F1 is never settled
    assert qa_f1("Paris", ["Paris"]) == 100.0 > qa_f1("Paris and more", ["Paris"])
    assert not settled("qa_f1", "Paris", ["Paris"])


def test_normalize_and_qa_f1():
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    assert qa_f1("Kingston", ["Kingston"]) == 100.0
    # pred {kingston, harbor}, ref {kingston}: P = 1/2, R = 1, F1 = 2/3
    assert qa_f1("The Kingston harbor.", ["Kingston"]) == pytest.approx(200 / 3)
    # max over references
    assert qa_f1("Ada Lind", ["Ada M. Lind", "Ada Lind"]) == 100.0
    # pred {ada, lind}, ref {ada, m, lind}: P = 1, R = 2/3, F1 = 0.8
    assert qa_f1("Ada Lind", ["Ada M. Lind"]) == pytest.approx(80.0)
    assert qa_f1("Paris", ["London"]) == 0.0
    assert qa_f1("", ["London"]) == 0.0


def test_rouge_l():
    # LCS("the cat sat on the mat", "the cat is on the mat") = 5 of 6 tokens each: F1 = 5/6
    assert rouge_l("the cat sat on the mat", ["the cat is on the mat"]) == pytest.approx(500 / 6)
    assert rouge_l("The cat, the mat.", ["the cat the mat"]) == 100.0
    # LCS = 2 ("a c"), P = 2/3, R = 2/4: F1 = 4/7
    assert rouge_l("a b c", ["a c d e"]) == pytest.approx(400 / 7)
    assert rouge_l("", ["a"]) == 0.0
    assert rouge_l("x y", ["z", "x y"]) == 100.0


def test_classification():
    assert classification("Location", ["Location"]) == 100.0
    assert classification("Human being", ["Location"]) == 0.0
    assert classification("Location\nHuman", ["Location"]) == 100.0  # first line only
    classes = ["Location", "Human", "Number"]
    assert classification("Location or Human", ["Location"], all_classes=classes) == 50.0
    # a class that is only a substring of the reference does not count against it
    classes = ["Abbreviation", "Abbreviation expansion"]
    assert classification("Abbreviation expansion", ["Abbreviation expansion"], classes) == 100.0


def test_retrieval_and_count():
    assert retrieval("The answer is Paragraph 3", ["Paragraph 3"]) == 100.0
    assert retrieval("Paragraph 3 or Paragraph 5", ["Paragraph 3"]) == 50.0
    assert retrieval("Paragraph 13", ["Paragraph 3"]) == 0.0
    assert retrieval("no idea", ["Paragraph 3"]) == 0.0
    assert count("2", ["2"]) == 100.0
    assert count("2 or 3", ["2"]) == 50.0
    assert count("none", ["2"]) == 0.0


def test_levenshtein_and_code_sim():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "abc") == 0
    # substitutions cost 2: k->s (2), e->i (2), +g (1) = 5
    assert levenshtein("kitten", "sitting", substitution_cost=2) == 5
    assert edit_similarity("kitten", "sitting") == pytest.approx(8 / 13)
    assert edit_similarity("", "") == 1.0
    assert code_sim("    return a + b", ["    return a + b"]) == 100.0
    # comment lines and fences are skipped; the first code line is compared
    assert code_sim("```python\n# add them\n    return a + b\nmore", ["    return a + b"]) == 100.0
    assert code_sim("abcd", ["abce"]) == pytest.approx(75.0)  # (8 - 2) / 8
    assert code_sim("# only a comment", ["x = 1"]) == 0.0


def test_registry_and_range():
    assert set(METRICS) == {
        "string_match_all",
        "string_match_part",
        "qa_f1",
        "rouge_l",
        "classification",
        "retrieval",
        "count",
        "code_sim",
    }
    preds = ["", "Paragraph 3", "the answer is 42", "x = 1\n", "Location"]
    refs = ["Paragraph 3", "42", "x = 1", "Location"]
    for name in METRICS:
        for p in preds:
            v = score(name, p, refs)
            assert isinstance(v, float) and 0.0 <= v <= 100.0, (name, p, v)
    with pytest.raises(ValueError, match="qa_f1"):
        score("bleu", "a", ["a"])
