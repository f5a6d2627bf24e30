"""A second, independently worded layout of RULER's retrieval and tracing tasks ("fmt2").

:mod:`kvsieve.tasks.ruler` is the generator kvsieve's policies were developed on. A policy can be
tuned to one layout without anyone noticing (KVzip's float32 collapse looked like a format problem:
docs/kvzip-format.md), so the harness can run the same tasks in a second layout, written apart from
the first, that differs the way a user's data may:

* another instruction wording ("A special magic number is hidden within the following text ...",
  singular or plural as the task needs);
* one haystack sentence per line (``"\\n"`` between units, never ``" "``), and every needle on its
  own line;
* a context that already ends with a newline (the prompt builder adds its own separator after it,
  so the compressed part ends in a blank line);
* an answer prefix with a leading space (``" The special magic number for ... is"``);
* its own prose haystack (:data:`_LINES`: short declarative sentences, not
  :class:`kvsieve.tasks.haystack.ProseStream`'s templates), RULER's noise sentences one per line,
  and distractor needles for the multikey tasks.

The needle sentence, questions and metric stay RULER's ("One of the special magic numbers for
{key} is: {value}.", string_match_all), so scores compare with the first layout task by task; the needles'
keys and values (and the distractor needles) are drawn as the first layout draws them
(:func:`kvsieve.tasks.ruler.draw_needles`, from this layout's own seed), so only the layout differs.
Task names carry the prefix ``fmt2:`` (``fmt2:niah_single_1``); :func:`base_task` strips it.
Deterministic for ``(task, length, seed)`` and the tokenizer.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from kvsieve.tasks import haystack as hs
from kvsieve.tasks.ruler import draw_needles, fit_units, needle
from kvsieve.tasks.sample import Sample

__all__ = ["PREFIX", "TASKS", "base_task", "generate", "is_alt_task"]

PREFIX = "fmt2:"
_BASE = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
         "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt")
TASKS: tuple[str, ...] = tuple(PREFIX + t for t in _BASE)

# base task -> haystack, key kind, value kind, keys inserted, values per key, keys asked for
_NIAH: dict[str, tuple[str, str, str, int, int, int]] = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("prose", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("prose", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("noise", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needles", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needles", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("prose", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("prose", "words", "numbers", 4, 1, 4),
}

# Sentence frames of this layout's prose haystack: short statements, one per line.
# Slots: {n}/{m} nouns, {a} adjective, {v} verb (base form); {An}/{Aa} with their article.
_LINES: tuple[str, ...] = (
    "{Aa} {n} stood at the end of the road.",
    "Nobody in town could {v} {An} like that.",
    "The {n} was {a} again this morning.",
    "We watched the {n} until the {m} went dark.",
    "Each winter the {m} learns to {v} once more.",
    "Her notes mention {Aa} {n} and little else.",
    "They decided to {v} the {n} before noon.",
    "The old {m} has never seen {An} so {a}.",
    "One {n} leads to another, and then to the {m}.",
    "It takes patience to {v} {Aa} {m}.",
)


def is_alt_task(task: str) -> bool:
    """Whether ``task`` names a task of this layout (``fmt2:...``)."""
    return isinstance(task, str) and task.startswith(PREFIX)


def base_task(task: str) -> str:
    """``fmt2:niah_single_1`` -> ``niah_single_1`` (the first layout's name of the same task)."""
    _check(task)
    return task[len(PREFIX):]


def _check(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown fmt2 task {task!r}; allowed: {', '.join(TASKS)}")


def _rng(task: str, seed: int, purpose: str) -> random.Random:
    return random.Random(f"kvsieve-fmt2:{task}:{seed}:{purpose}")


class _Prose:
    """A seeded, prefix-stable list of haystack lines from :data:`_LINES`."""

    def __init__(self, seed: str) -> None:
        self._rng = random.Random(f"kvsieve-fmt2-prose:{seed}")
        self._lines: list[str] = []

    def take(self, n: int) -> list[str]:
        nouns, adjectives, verbs = hs.nouns(), hs.adjectives(), hs.verbs()
        while len(self._lines) < n:
            r = self._rng
            noun, adjective = r.choice(nouns), r.choice(adjectives)
            line = r.choice(_LINES).format(n=noun, m=r.choice(nouns), a=adjective, v=r.choice(verbs),
                                           An=hs.with_article(noun), Aa=hs.with_article(adjective))
            self._lines.append(line[0].upper() + line[1:])
        return self._lines[:n]


@dataclass
class _Layout:
    head: str  # instruction line(s), ending with "\n"
    items: list[tuple[float, str, bool]]  # (depth in [0, 1], line, relevant)
    units: Callable[[int], list[str]]  # the first n haystack lines
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int


def _lines(layout: _Layout, n: int) -> tuple[str, list[tuple[int, int]]]:
    """Head, then the haystack's first ``n`` lines with the items inserted, one line each; ends in "\\n"."""
    units = layout.units(n)
    rows: list[tuple[str, bool]] = [(u, False) for u in units]
    # an item at depth d goes before line floor(d * n); later items at the same place go after earlier ones
    for offset, (depth, text, relevant) in enumerate(sorted(layout.items, key=lambda it: it[0])):
        rows.insert(min(int(depth * len(units)), len(units)) + offset, (text, relevant))
    text, spans = layout.head, []
    for line, relevant in rows:
        if relevant:
            spans.append((len(text), len(text) + len(line)))
        text += line + "\n"
    return text, spans


def _niah(task: str, seed: int) -> _Layout:
    hay, key_kind, value_kind, n_keys, n_values, n_asked = _NIAH[base_task(task)]
    rng = _rng(task, seed, "needles")
    one = value_kind[:-1]  # "number" / "uuid"
    drawn = draw_needles(rng, key_kind, value_kind, n_keys, n_values)  # the first layout's drawing, this rng
    keys, values = drawn.keys, drawn.values
    items = [(rng.random(), needle(value_kind, k, v), i < n_asked)
             for i, (k, row) in enumerate(zip(keys, values, strict=True)) for v in row]

    if hay == "noise":
        def units(n: int) -> list[str]:
            return [hs.NOISE] * n  # RULER's noise paragraph, once per line
    elif hay == "prose":
        units = _Prose(f"{task}:{seed}").take
    else:
        units = hs.UnitStream(drawn.distractors(), f"fmt2:{task}:{seed}").take

    hidden = len(items)
    if hay == "needles":
        head = (f"Many special magic {value_kind} are hidden within the following text. Make sure to memorize "
                f"them. I will quiz you about one of them afterwards.\n")
    elif hidden == 1:
        head = (f"A special magic {one} is hidden within the following text. Make sure to memorize it. "
                f"I will quiz you about the {one} afterwards.\n")
    else:
        head = (f"{hidden} special magic {value_kind} are hidden within the following text. Make sure to "
                f"memorize them. I will quiz you about some of them afterwards.\n")
    asked = keys[:n_asked]
    query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + " and " + asked[-1]
    answers = [v for row in values[:n_asked] for v in row]
    if len(answers) == 1:
        question = f"What is the special magic {one} for {query} mentioned in the provided text?"
        prefix = f" The special magic {one} for {query} mentioned in the provided text is"
        max_new = 32 if value_kind == "numbers" else 64
    else:
        question = f"What are all the special magic {value_kind} for {query} mentioned in the provided text?"
        prefix = f" The special magic {value_kind} for {query} mentioned in the provided text are"
        max_new = 128
    return _Layout(head, items, units, question, prefix, answers, max_new)


def _vt(task: str, seed: int) -> _Layout:
    rng = _rng(task, seed, "chain")
    value = str(rng.randint(10_000, 99_999))
    names: list[str] = []
    while len(names) < 5:  # one chain of 4 hops, as RULER's default
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names and name.lower() not in hs.NOISE.lower():
            names.append(name)
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
    depths = sorted(rng.random() for _ in lines)  # in order: the chain reads top to bottom
    head = "Some variable assignments are hidden in the lines below. Follow every chain of assignments.\n"
    return _Layout(head, [(d, s, True) for d, s in zip(depths, lines, strict=True)], lambda n: [hs.NOISE] * n,
                   f"Which variables are assigned the value {value} in the text above?",
                   f" Following the chain of assignments, the variables assigned the value {value} are:",
                   names, 48)


def generate(task: str, length: int, seed: int, count_tokens: Callable[[str], int],
             template_overhead: int = 0) -> Sample:
    """One ``fmt2:`` sample whose context (plus ``template_overhead``) fills at most ``length`` tokens.

    Same contract as :func:`kvsieve.tasks.ruler.generate`: ``count_tokens`` is the model's tokenizer,
    ``template_overhead`` the tokens the chat template, question and answer prefix add.
    """
    _check(task)
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    layout = _vt(task, seed) if base_task(task) == "vt" else _niah(task, seed)
    n = fit_units(lambda k: _lines(layout, k)[0], length, count_tokens, template_overhead,
                  what=f"task {task!r}")
    context, spans = _lines(layout, n)
    return Sample(id=f"{task}-{length}-{seed}", task=task, context=context, question=layout.question,
                  answer_prefix=layout.answer_prefix, answers=list(layout.answers),
                  max_new_tokens=layout.max_new_tokens, length=length, seed=seed, metric="string_match_all",
                  spans=spans)
