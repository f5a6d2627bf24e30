"""Haystack text for the synthetic tasks.

RULER (NVIDIA RULER, arXiv 2404.06654) uses two haystacks: a repeated noise paragraph and Paul Graham's
essays. The essays are not shipped with kvsieve (no network, no bundled corpus), so the documented local
substitute is :class:`ProseStream`: seeded, varied English prose built from the ``wonderwords`` word lists
with a dozen sentence templates. It is grammatical-looking nonsense, which is what a haystack needs to be:
natural token statistics, nothing the question could be answered from.

Everything here is deterministic for a given seed (``random.Random`` seeded with a string is stable
across processes and Python builds, unlike ``hash()``).
"""

from __future__ import annotations

import random
from functools import cache
from importlib.resources import files

__all__ = [
    "NOISE",
    "NOISE_SENTENCES",
    "ProseStream",
    "UnitStream",
    "adjectives",
    "all_words",
    "nouns",
    "verbs",
    "noise_units",
    "prose",
    "with_article",
]

# RULER's repeated noise haystack (RULER, scripts/data/synthetic/niah.py: the "noise" haystack).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


@cache
def _profanities() -> frozenset[str]:
    return frozenset(_read_asset("profanitylist.txt"))


def _read_asset(name: str) -> list[str]:
    text = files("wonderwords").joinpath("assets").joinpath(name).read_text(encoding="utf-8")
    return [w.strip() for w in text.splitlines() if w.strip()]


def all_words() -> frozenset[str]:
    """Every word of the three (filtered) lists."""
    return _all_words()


@cache
def _all_words() -> frozenset[str]:
    return frozenset(nouns() + adjectives() + verbs())


@cache
def _words(name: str) -> tuple[str, ...]:
    bad = _profanities()
    words = {w for w in _read_asset(name) if w.isascii() and w.isalpha() and w.islower() and 3 <= len(w) <= 12}
    return tuple(sorted(words - bad))


def nouns() -> tuple[str, ...]:
    """wonderwords nouns: lowercase, alphabetic, 3-12 letters, no profanity, sorted."""
    return _words("nounlist.txt")


def adjectives() -> tuple[str, ...]:
    """wonderwords adjectives, filtered like :func:`nouns`."""
    return _words("adjectivelist.txt")


@cache
def verbs() -> tuple[str, ...]:
    """wonderwords verbs, filtered like :func:`nouns`, without the few past-tense forms in the list."""
    return tuple(w for w in _words("verblist.txt") if not (w.endswith("ed") and not w.endswith("eed") and len(w) > 4))


def with_article(word: str) -> str:
    """'a lake' / 'an owl' (first-letter heuristic)."""
    return ("an " if word[0] in "aeiou" else "a ") + word


# Sentence templates. Slots: {a1}/{a2} adjectives, {n1}/{n2}/{n3} nouns, {v} verb (base form);
# {An1}/{Aa1} put an article before n1/a1.
_TEMPLATES: tuple[str, ...] = (
    "The {a1} {n1} will {v} the {n2} before the {n3} arrives.",
    "{An1} is rarely as {a1} as the {n2} next to it.",
    "Nobody expected the {n1} to {v} so close to the {a1} {n2}.",
    "If you {v} the {n1}, the {n2} becomes strangely {a1}.",
    "Every {n1} in the {a1} {n2} tries to {v} at least once a year.",
    "She said that the {n1} was {a1}, but the {n2} seemed {a2} to everyone else.",
    "In the {a1} {n1}, we learned to {v} without {An2}.",
    "The {n1} and the {n2} {v} together whenever the {n3} is {a1}.",
    "Why would anyone {v} {Aa1} {n1} during the {n2}?",
    "Perhaps the {n1} knows how to {v} the {n2}, or perhaps it is simply {a1}.",
    "After a long {n1}, the {a1} {n2} finally decided to {v}.",
    "There is {Aa1} {n1} behind every {a2} {n2}.",
    "My grandmother kept {Aa1} {n1} in the {n2} and never explained why.",
    "It is hard to {v} {An1} when the {n2} is this {a1}.",
    "Some people {v} their {n1}; others simply wait for the {a1} {n2}.",
    "By the time the {n1} was {a1}, the {n2} had already begun to {v}.",
)


class ProseStream:
    """An endless, seeded stream of prose sentences; ``sentences(n)`` is prefix-stable.

    ``ProseStream(seed).sentences(10)`` is always the first 10 sentences of
    ``ProseStream(seed).sentences(1000)``, so a caller can grow a haystack one sentence at a time.
    """

    def __init__(self, seed: int | str) -> None:
        self._rng = random.Random(f"kvsieve-prose:{seed}")
        self._cache: list[str] = []

    def _next(self) -> str:
        rng = self._rng
        n, a, v = nouns(), adjectives(), verbs()
        template = rng.choice(_TEMPLATES)
        slots = {
            "a1": rng.choice(a),
            "a2": rng.choice(a),
            "n1": rng.choice(n),
            "n2": rng.choice(n),
            "n3": rng.choice(n),
            "v": rng.choice(v),
        }
        slots["An1"] = with_article(slots["n1"])
        slots["An2"] = with_article(slots["n2"])
        slots["Aa1"] = with_article(slots["a1"])
        sentence = template.format(**slots)
        return sentence[0].upper() + sentence[1:]

    def sentences(self, n: int) -> list[str]:
        """The first ``n`` sentences of the stream."""
        while len(self._cache) < n:
            self._cache.append(self._next())
        return self._cache[:n]

    def sentence(self, i: int) -> str:
        """Sentence ``i`` (0-based) of the stream."""
        while len(self._cache) <= i:
            self._cache.append(self._next())
        return self._cache[i]


def prose(n_sentences: int, seed: int | str) -> str:
    """``n_sentences`` sentences of seeded prose joined by spaces."""
    return " ".join(ProseStream(seed).sentences(n_sentences))


def noise_units(n: int) -> list[str]:
    """RULER's noise haystack cut into sentences: the five noise sentences, cycled, ``n`` in all."""
    return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(n)]


class UnitStream:
    """A lazily grown, prefix-stable list of haystack units produced by ``make(rng)``."""

    def __init__(self, make, seed: int | str) -> None:
        self._make = make
        self._rng = random.Random(f"kvsieve-units:{seed}")
        self._cache: list[str] = []

    def take(self, n: int) -> list[str]:
        while len(self._cache) < n:
            self._cache.append(self._make(self._rng))
        return self._cache[:n]
