"""A long-output task: list every planted fact of the context, in order (``fact_list``).

Decode-time eviction (``kvsieve eval --mode decode``) holds the cache under its budget while the answer is
generated, so what it must keep changes as the answer goes on: the facts not yet written out matter, the ones
already written matter less, and the answer itself takes room in the cache. A task that asks for one needle
and a 7-digit answer cannot show that; this one asks for an answer of a few hundred tokens that depends on
facts spread through the whole context.

The context: an instruction head, then seeded prose (:class:`kvsieve.tasks.haystack.ProseStream`) with
:data:`RECORDS` numbered records planted through it, record ``i`` in the ``i``-th of :data:`RECORDS` equal
slices of the haystack (at a seeded depth inside its slice), so the records are in order and spread from the
start to the end::

    Record 3 is 4839201.

The key of a fact is its record number, its value one of RULER's 7-digit numbers, all distinct
(:func:`kvsieve.tasks.ruler.draw_needles`). (A first draft named each record by a word key as well, "Record 3:
the code for quiet-harbor is 4839201."; SmolLM2-135M then drifted into copying the haystack and recalled 5 of 16
with the full cache, too little to compare policies on.) The question asks for all records in order, one per
line, in that same form; the answer prefix starts the first line. The reference answer (``answers``) is the list of
values: the metric is RULER's ``string_match_all``, i.e. 100 x the fraction of the values that appear in the
prediction (a 7-digit number is not guessed by chance). ``max_new_tokens`` is the reference listing's own
length in the model's tokens plus :data:`SLACK`, so the model has room for every line and the answer is long
(350 tokens for SmolLM2's tokenizer, which spells numbers digit by digit).

Deterministic for ``(length, seed)`` and the tokenizer (``random.Random`` seeded with a string).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvsieve.tasks import haystack as hs
from kvsieve.tasks.ruler import draw_needles, fit_units
from kvsieve.tasks.sample import Sample

__all__ = ["TASKS", "RECORDS", "SLACK", "generate", "record", "reference_listing", "is_fact_list_task"]

TASKS: tuple[str, ...] = ("fact_list",)
RECORDS = 24  # facts planted per context
SLACK = 24  # tokens of max_new_tokens beyond the reference listing's length


def is_fact_list_task(task: str) -> bool:
    return task in TASKS


def record(index: int, value: str) -> str:
    """Record ``index`` (1-based) as it stands in the context and as the answer should repeat it."""
    return f"Record {index} is {value}."


def reference_listing(values: list[str]) -> str:
    """The ideal answer: every record in order, one per line."""
    return "\n".join(record(i + 1, v) for i, v in enumerate(values))


def _layout(seed: int) -> tuple[list[str], list[float], hs.ProseStream]:
    rng = random.Random(f"kvsieve-fact-list:{seed}")
    drawn = draw_needles(rng, "words", "numbers", RECORDS, 1)
    # record i at a depth inside the i-th of RECORDS equal slices: in order, spread through the haystack
    depths = [(i + 0.1 + 0.8 * rng.random()) / RECORDS for i in range(RECORDS)]
    return [row[0] for row in drawn.values], depths, hs.ProseStream(f"fact_list:{seed}")


def _context(values: list[str], depths: list[float], units: list[str]) -> tuple[str, list]:
    head = (f"{RECORDS} numbered records are hidden within the following text. Make sure to memorize them. "
            f"I will ask you to list all of them afterwards.\n")
    slots: dict[int, list[int]] = {}
    for i, depth in enumerate(depths):
        slots.setdefault(round(depth * len(units)), []).append(i)
    parts, spans, pos = [head], [], len(head)
    first = True
    for u in range(len(units) + 1):
        pieces = [(record(i + 1, values[i]), True) for i in slots.get(u, ())]
        if u < len(units):
            pieces.append((units[u], False))
        for text, relevant in pieces:
            if not first:
                parts.append(" ")
                pos += 1
            first = False
            if relevant:
                spans.append((pos, pos + len(text)))
            parts.append(text)
            pos += len(text)
    return "".join(parts), spans


def generate(task: str, length: int, seed: int, count_tokens: Callable[[str], int],
             template_overhead: int = 0) -> Sample:
    """One ``fact_list`` sample whose context (plus ``template_overhead``) fills at most ``length`` tokens.

    Same contract as :func:`kvsieve.tasks.ruler.generate`; ``count_tokens`` (the model's tokenizer) also sizes
    ``max_new_tokens``. Raises ValueError for another task name, a length that is not a positive int, or one too
    small to hold the records.
    """
    if task not in TASKS:
        raise ValueError(f"unknown long-output task {task!r}; allowed: {', '.join(TASKS)}")
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    values, depths, stream = _layout(seed)
    n = fit_units(lambda k: _context(values, depths, stream.sentences(k))[0], length, count_tokens,
                  template_overhead, what=f"task {task!r} ({RECORDS} records)")
    context, spans = _context(values, depths, stream.sentences(n))
    question = (f"List all {RECORDS} records of the text above in order, one per line, each in the form "
                "'Record N is VALUE.'")
    prefix = "Record 1 is"
    listing = reference_listing(values)
    return Sample(id=f"{task}-{length}-{seed}", task=task, context=context, question=question,
                  answer_prefix=prefix, answers=list(values), max_new_tokens=count_tokens(listing) + SLACK,
                  length=length, seed=seed, metric="string_match_all", spans=spans)
