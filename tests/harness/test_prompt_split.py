"""The rule that cuts an lm-eval prompt into context, question and answer prefix (``harness/prompt_split.py``),
on RULER-shaped strings written out here."""

from __future__ import annotations

import pytest

from kvsieve.harness.prompt_split import split_prompt

RULER_LIKE = ("A special magic number is hidden within the following text.\nThe grass is green. One of the special "
              "magic numbers for empty-mantle is: 3438234.\nThe sky is blue.\nWhat is the special magic number for "
              "empty-mantle mentioned in the provided text?")
GEN_PREFIX = "The special magic number for empty-mantle mentioned in the provided text is"


def test_ruler_prompt_splits_into_context_question_and_answer_prefix():
    s = split_prompt(RULER_LIKE + " " + GEN_PREFIX, GEN_PREFIX)
    assert not s.question_aware and s.rule == "last line"
    assert s.question == "What is the special magic number for empty-mantle mentioned in the provided text?"
    assert s.context.endswith("The sky is blue.") and "3438234" in s.context
    assert s.answer_prefix == GEN_PREFIX


def test_prompt_without_a_question_line_is_question_aware():
    one_line = "Summarise: " + "the grass is green and the sky is blue, " * 20
    s = split_prompt(one_line)
    assert s.question_aware and s.question == "" and s.context == one_line.rstrip()
    long_last = "Header\n" + "a long final paragraph that is mostly context " * 10
    t = split_prompt(long_last)
    assert t.question_aware and "longer" in t.rule
    assert split_prompt(RULER_LIKE, qa="always").question_aware
    with pytest.raises(ValueError, match="qa"):
        split_prompt(RULER_LIKE, qa="sometimes")


def test_gen_prefix_is_only_cut_when_the_prompt_ends_with_it():
    s = split_prompt(RULER_LIKE, "Answer:")
    assert s.answer_prefix == "" and s.question.startswith("What is")
