"""The 13 RULER tasks (NVIDIA RULER, arXiv 2404.06654), generated locally and deterministically.

Each task builds a context from haystack *units* (noise sentences, prose sentences, distractor needles,
distractor documents, list entries) around a fixed set of relevant items (needles, chain statements,
gold documents). All random choices are made up front from ``(task, seed)``; only the number of units
varies, and it is fitted with the model's own tokenizer so that ``count_tokens(context) + template_overhead``
is as close to ``length`` as possible without exceeding it.

Differences from RULER, by design or for lack of data (documented, deliberate):

* Paul Graham essays -> seeded wonderwords prose (:class:`kvsieve.tasks.haystack.ProseStream`).
* qa_1 / qa_2 (SQuAD / HotpotQA in RULER) -> generated documents of invented facts with distractor
  documents of the same kinds; qa_2 needs two hops across two documents.
* The question is never part of ``context`` (query-agnostic compression); RULER's instruction preamble
  ("Some special magic numbers are hidden ...") is kept at the head of the context.
* niah_multikey_1 uses the noise haystack (RULER uses the essays); cwe adapts the frequency of the common
  words to short lengths; fwe assigns Zipf(alpha=2) counts deterministically instead of sampling them
  and omits RULER's '....' separators; vt uses one chain of 4 hops (RULER's default) with 5-digit values.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from kvsieve.tasks import haystack as hs
from kvsieve.tasks.sample import Sample

__all__ = ["TASKS", "Needles", "draw_needles", "generate", "generate_many", "fit_units", "needle", "task_family"]

CountTokens = Callable[[str], int]

TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)

_MAX_UNITS = 1 << 24


@dataclass
class _Built:
    context: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    answers: list[str] | None = None  # when the answers depend on the number of units (cwe, fwe)


@dataclass
class _Spec:
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int
    metric: str
    build: Callable[[int], _Built]
    stop: list[str] = field(default_factory=list)
    max_units: int | None = None


def task_family(task: str) -> str:
    """RULER's task category (retrieval, multi-hop tracing, aggregation, qa); other tasks are their own family.
    A task of the second layout (``fmt2:niah_single_1``) is in its base task's family."""
    task = task.split(":", 1)[1] if task.startswith("fmt2:") else task
    if task.startswith("niah_"):
        return "retrieval"
    return {"vt": "multi_hop", "cwe": "aggregation", "fwe": "aggregation", "qa_1": "qa", "qa_2": "qa"}.get(task, task)


# ----------------------------------------------------------------------------------------------- helpers


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; allowed: {', '.join(TASKS)}")


def _rng(task: str, seed: int, purpose: str = "") -> random.Random:
    return random.Random(f"kvsieve-ruler:{task}:{seed}:{purpose}")


def _word_key(rng: random.Random) -> str:
    """A RULER-style word key such as 'purple-lake' (adjective-noun)."""
    return f"{rng.choice(hs.adjectives())}-{rng.choice(hs.nouns())}"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))  # 7 digits, as in RULER


def needle(kind: str, key: str, value: str) -> str:
    """RULER's needle sentence; ``kind`` is the values' plural (``numbers``, ``uuids``)."""
    return f"One of the special magic {kind} for {key} is: {value}."


def _clashes(key: str, others: Iterable[str]) -> bool:
    """'purple-lake' inside 'purple-lakeshore' would make matching the answer's key ambiguous."""
    return any(key in o or o in key for o in others)


@dataclass
class Needles:
    """The keys and values of a NIAH task's needles: ``values[i]`` are key ``i``'s, all values distinct."""

    value_kind: str  # "numbers" or "uuids"
    keys: list[str]
    values: list[list[str]]
    make_key: Callable[[random.Random], str]
    make_value: Callable[[random.Random], str]

    def distractors(self) -> Callable[[random.Random], str]:
        """A maker of distractor needles (for a haystack of needles): each with a key and a value not used
        before in this sample and a key that clashes with none of the real ones."""
        taken = set(self.keys)
        used = {v for row in self.values for v in row}

        def distractor(r: random.Random) -> str:
            while True:
                k, v = self.make_key(r), self.make_value(r)
                if k not in taken and v not in used and not _clashes(k, self.keys):
                    taken.add(k)
                    return needle(self.value_kind, k, v)

        return distractor


def draw_needles(rng: random.Random, key_kind: str, value_kind: str, n_keys: int, n_values: int) -> Needles:
    """``n_keys`` distinct, non-clashing keys (``words`` or ``uuids``), then ``n_values`` values (``numbers`` or
    ``uuids``) per key, none repeated; drawn from ``rng`` in that order (both RULER layouts use it)."""
    make_key = _word_key if key_kind == "words" else _uuid
    make_value = _number if value_kind == "numbers" else _uuid
    keys: list[str] = []
    while len(keys) < n_keys:
        k = make_key(rng)
        if not _clashes(k, keys):
            keys.append(k)
    values: list[list[str]] = []
    seen: set[str] = set()
    for _ in keys:
        row: list[str] = []
        while len(row) < n_values:
            v = make_value(rng)
            if v not in seen:
                seen.add(v)
                row.append(v)
        values.append(row)
    return Needles(value_kind, keys, values, make_key, make_value)


def _interleave(
    units: list[str], items: list[tuple[float, str, bool]], sep: str, head: str
) -> tuple[str, list[tuple[int, int]]]:
    """Insert ``items`` (depth in [0, 1], text, relevant) between ``units``; return text and relevant spans.

    An item at depth d goes before unit ``round(d * len(units))``; items at the same place keep their order.
    """
    slots: dict[int, list[tuple[str, bool]]] = {}
    for depth, text, relevant in items:
        slots.setdefault(round(depth * len(units)), []).append((text, relevant))
    pieces: list[tuple[str, bool]] = []
    for i in range(len(units) + 1):
        pieces.extend(slots.get(i, ()))
        if i < len(units):
            pieces.append((units[i], False))
    parts = [head]
    pos = len(head)
    spans: list[tuple[int, int]] = []
    for j, (text, relevant) in enumerate(pieces):
        if j:
            parts.append(sep)
            pos += len(sep)
        if relevant:
            spans.append((pos, pos + len(text)))
        parts.append(text)
        pos += len(text)
    return "".join(parts), spans


def _join_query(keys: list[str]) -> str:
    if len(keys) == 1:
        return keys[0]
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


def fit_units(
    build: Callable[[int], str],
    length: int,
    count_tokens: CountTokens,
    template_overhead: int = 0,
    what: str = "context",
    max_units: int | None = None,
) -> int:
    """The largest unit count n with ``count_tokens(build(n)) + template_overhead <= length``.

    Assumes the token count grows (roughly) with n: it extrapolates from two probes, brackets the guess,
    then bisects. Only counts it has measured are returned, so the result always fits. ``max_units`` caps n
    (a task that runs out of material stops there, shorter than ``length``). Raises ValueError naming the
    length when even ``build(0)`` does not fit.
    """
    memo: dict[int, int] = {}

    def cost(n: int) -> int:
        if n not in memo:
            memo[n] = count_tokens(build(n)) + template_overhead
        return memo[n]

    def fits(n: int) -> bool:
        return cost(n) <= length

    if not fits(0):
        raise ValueError(
            f"length {length} is too small for {what}: without any haystack it already needs {cost(0)} tokens "
            f"(template overhead {template_overhead} included)"
        )
    limit = _MAX_UNITS if max_units is None else max_units

    def at_limit() -> int:
        if max_units is None:
            raise ValueError(f"count_tokens does not grow with the {what}; cannot fill length {length}")
        return limit

    if limit <= 0:
        return 0
    probe = min(16, limit)
    if not fits(probe):
        lo, hi = 0, probe
    else:
        if probe == limit:
            return at_limit()
        rate = max((cost(probe) - cost(0)) / probe, 1e-6)
        guess = min(max(probe + 1, int((length - cost(0)) / rate)), limit)
        step = max(1, guess // 32)
        if fits(guess):
            lo = guess
            while True:
                if lo == limit:
                    return at_limit()
                hi = min(lo + step, limit)
                if not fits(hi):
                    break
                lo, step = hi, step * 2
        else:
            lo, hi = max(probe, guess - step), guess
            while not fits(lo):
                hi, step = lo, step * 2
                lo = max(probe, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------------------------------------- NIAH

# haystack, key type, value type, number of keys inserted, values per key, keys queried
_NIAH: dict[str, tuple[str, str, str, int, int, int]] = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("noise", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}


def _niah(task: str, seed: int) -> _Spec:
    hay, key_type, value_type, n_keys, n_values, n_queries = _NIAH[task]
    rng = _rng(task, seed)
    singular = value_type[:-1]
    drawn = draw_needles(rng, key_type, value_type, n_keys, n_values)
    keys, values = drawn.keys, drawn.values
    queries = keys[:n_queries]
    items = [
        (rng.random(), needle(value_type, k, v), ki < n_queries)
        for ki, (k, vs) in enumerate(zip(keys, values, strict=True))
        for v in vs
    ]
    answers = [v for vs in values[:n_queries] for v in vs]

    if hay == "noise":

        def units(n: int) -> list[str]:
            return hs.noise_units(n)
    elif hay == "essay":
        stream = hs.ProseStream(f"{task}:{seed}")
        units = stream.sentences
    else:  # a haystack of distractor needles with other keys and values
        units = hs.UnitStream(drawn.distractors(), f"{task}:{seed}").take

    head = (
        f"Some special magic {value_type} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {value_type} afterwards.\n"
    )

    def build(n: int) -> _Built:
        context, spans = _interleave(units(n), items, " " if hay != "needle" else "\n", head)
        return _Built(context, spans)

    query = _join_query(queries)
    if n_queries == 1 and n_values == 1:
        question = f"What is the special magic {singular} for {query} mentioned in the provided text?"
        prefix = f"The special magic {singular} for {query} mentioned in the provided text is"
    else:
        question = f"What are all the special magic {value_type} for {query} mentioned in the provided text?"
        prefix = f"The special magic {value_type} for {query} mentioned in the provided text are"
    if len(answers) > 1:
        max_new = 128
    else:
        max_new = 32 if value_type == "numbers" else 64
    return _Spec(question, prefix, answers, max_new, "string_match_all", build)


# --------------------------------------------------------------------------------------- variable tracking


def _vt(task: str, seed: int) -> _Spec:
    rng = _rng(task, seed)
    n_hops = 4
    value = str(rng.randint(10_000, 99_999))
    names: list[str] = []
    while len(names) < n_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names and name.lower() not in hs.NOISE.lower():
            names.append(name)
    statements = [f"VAR {names[0]} = {value}."]
    statements += [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, n_hops + 1)]
    depths = sorted(rng.random() for _ in statements)  # sorted: the chain reads in order
    items = [(d, s, True) for d, s in zip(depths, statements, strict=True)]
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"

    def build(n: int) -> _Built:
        context, spans = _interleave(hs.noise_units(n), items, " ", head)
        return _Built(context, spans)

    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"According to the chain(s) of variable assignment in the text above, {len(names)} variables are "
        f"assigned the value {value}, they are:"
    )
    return _Spec(question, prefix, names, 48, "string_match_all", build)


# ------------------------------------------------------------------------------ common words extraction

_CWE_NUM = 10
_CWE_FREQ_UNCOMMON = 3
_CWE_FREQ_COMMON = (30, 20, 10, 6)  # RULER uses 30 (common) vs 3 (uncommon); smaller for short contexts


def _cwe_pool() -> list[str]:
    return sorted({w for w in hs.nouns() + hs.adjectives() + hs.verbs() if len(w) >= 4})


def _cwe(task: str, seed: int, length: int, count_tokens: CountTokens, overhead: int) -> _Spec:
    rng = _rng(task, seed)
    pool = _cwe_pool()
    rng.shuffle(pool)
    common: list[str] = []
    for w in pool:  # common words must not contain one another
        if len(common) < _CWE_NUM and not any(w in c or c in w for c in common):
            common.append(w)
    # an uncommon word containing a common one would make string matching on the prediction ambiguous
    uncommon = [w for w in pool if w not in common and not any(c in w for c in common)]
    head = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n"
    )

    def builder(freq_common: int) -> Callable[[int], _Built]:
        # Past the pool every uncommon word is reused; cap so that no uncommon word reaches freq_common.
        cap = len(uncommon) * max(1, (freq_common - 1) // _CWE_FREQ_UNCOMMON)

        def build(n: int) -> _Built:
            n = min(n, cap)
            entries = common * freq_common + [uncommon[i % len(uncommon)] for i in range(n)] * _CWE_FREQ_UNCOMMON
            random.Random(f"kvsieve-ruler:{task}:{seed}:shuffle:{freq_common}:{n}").shuffle(entries)
            return _Built(head + " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)))

        return build

    chosen = None
    for freq in _CWE_FREQ_COMMON:
        # Prefer the largest frequency whose common block takes at most half of the budget.
        if count_tokens(builder(freq)(0).context) + overhead <= length / 2:
            chosen = freq
            break
    if chosen is None:
        chosen = _CWE_FREQ_COMMON[-1]
    question = f"What are the {_CWE_NUM} most common words in the list above?"
    prefix = f"The top {_CWE_NUM} words that appear most often in the list are:"
    cap = len(uncommon) * max(1, (chosen - 1) // _CWE_FREQ_UNCOMMON)
    return _Spec(question, prefix, list(common), 128, "string_match_all", builder(chosen), max_units=cap)


# ---------------------------------------------------------------------------- frequent words extraction

_FWE_VOCAB = 800
_FWE_ALPHA = 2.0
_FWE_MIN_WORDS = 60  # below this the Zipf counts cannot separate the top three


def _fwe_counts(n: int) -> list[int]:
    """Deterministic Zipf(alpha) counts for ``n`` words over ranks 1..V; the remainder goes to rank 1."""
    weights = [r**-_FWE_ALPHA for r in range(1, _FWE_VOCAB + 1)]
    total = sum(weights)
    counts = [int(n * w / total) for w in weights]
    counts[0] += n - sum(counts)
    return counts


def _fwe(task: str, seed: int) -> _Spec:
    rng = _rng(task, seed)
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < _FWE_VOCAB:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 7)))
        if w in seen:
            continue
        # no answer (top three) may contain, or be contained in, another coded word: string matching
        # on the prediction would be ambiguous
        if len(vocab) < 3 and any(w in o or o in w for o in vocab):
            continue
        if len(vocab) >= 3 and any(a in w for a in vocab[:3]):
            continue
        seen.add(w)
        vocab.append(w)
    head = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words.\n"
    )

    def build(k: int) -> _Built:
        n = _FWE_MIN_WORDS + k
        counts = _fwe_counts(n)
        assert counts[2] > counts[3], "fwe: top-3 counts not separated"
        words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
        random.Random(f"kvsieve-ruler:{task}:{seed}:shuffle:{n}").shuffle(words)
        return _Built(head + " ".join(words))

    question = (
        "Do not provide any explanation. What are the three most frequently appeared words in the above coded text?"
    )
    prefix = "According to the coded text above, the three most frequently appeared words are:"
    return _Spec(question, prefix, vocab[:3], 50, "string_match_all", build)


# -------------------------------------------------------------------------------------------------- QA

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "n", "r", "l", "s", "k", "th", "m", "sk")


class _Names:
    """Unique invented proper names ('Velmora', 'Tarsk') drawn from a seeded rng.

    Names made while ``protect`` is set (the gold entities) are also kept from being a substring of any
    other name, or containing one, so that string matching on the answer stays unambiguous.
    """

    def __init__(self) -> None:
        self.used: set[str] = set()
        self.protected: list[str] = []
        self.protect = False

    def __call__(self, rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
        while True:
            k = rng.randint(*syllables)
            name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(k))
            name = name.capitalize()
            if not 4 <= len(name) <= 14 or name in self.used or name.lower() in hs.all_words():
                continue
            if any(name in p or p in name for p in self.protected):
                continue
            if self.protect and any(name in u or u in name for u in self.used):
                continue
            self.used.add(name)
            if self.protect:
                self.protected.append(name)
            return name

    def person(self, rng: random.Random) -> str:
        return f"{self(rng, (2, 2))} {self(rng, (2, 3))}"


# one-hop facts: (sentence, question); {a} is the subject, {b} the answer
_FACTS: tuple[tuple[str, str], ...] = (
    ("The capital of the invented country {a} is {b}.", "What is the capital of the invented country {a}?"),
    ("The river {a} flows into the lake known as {b}.", "Into which lake does the river {a} flow?"),
    ("The ship {a} was built in the harbor town of {b}.", "In which harbor town was the ship {a} built?"),
    ("The scientist {a} discovered the mineral called {b}.", "Which mineral did the scientist {a} discover?"),
    ("The poet {a} wrote the epic poem titled {b}.", "What is the title of the epic poem written by the poet {a}?"),
)
_PERSON_FACTS = {3, 4}  # facts whose subject is a person

# two-hop facts: (sentence 1 with {a}->{b}, sentence 2 with {b}->{c}, question about {a}); answer {c}
_CHAINS: tuple[tuple[str, str, str], ...] = (
    (
        "The painter {a} was born in the city of {b}.",
        "The city of {b} lies in the invented country of {c}.",
        "In which invented country was the painter {a} born?",
    ),
    (
        "The ship {a} was built in the harbor town of {b}.",
        "The harbor town of {b} was founded by the explorer {c}.",
        "Which explorer founded the town where the ship {a} was built?",
    ),
    (
        "The scientist {a} spent her whole career at the {b} Institute.",
        "The {b} Institute is located in the mountain town of {c}.",
        "In which town is the institute where the scientist {a} worked located?",
    ),
)
_PERSON_CHAINS = {0: ("a",), 1: ("c",), 2: ("a",)}


def _document(body: str, rng: random.Random, prose: Callable[[random.Random], str]) -> str:
    """A document: the fact sentence surrounded by 2-4 filler sentences."""
    filler = [prose(rng) for _ in range(rng.randint(2, 4))]
    filler.insert(rng.randint(0, len(filler)), body)
    return " ".join(filler)


def _qa(task: str, seed: int) -> _Spec:
    rng = _rng(task, seed)
    names = _Names()
    filler_stream = hs.ProseStream(f"{task}:{seed}:filler")
    filler_i = [0]

    def prose(_: random.Random) -> str:  # filler sentences are drawn in document order, so prefix-stable
        filler_i[0] += 1
        return filler_stream.sentence(filler_i[0] - 1)

    def subject(r: random.Random, person: bool) -> str:
        return names.person(r) if person else names(r)

    names.protect = True
    if task == "qa_1":
        fi = rng.randrange(len(_FACTS))
        sent, q = _FACTS[fi]
        a, b = subject(rng, fi in _PERSON_FACTS), names(rng)
        gold = [_document(sent.format(a=a, b=b), rng, prose)]
        question, answer = q.format(a=a), b
    else:
        ci = rng.randrange(len(_CHAINS))
        s1, s2, q = _CHAINS[ci]
        persons = _PERSON_CHAINS[ci]
        a = subject(rng, "a" in persons)
        b = names(rng)
        c = subject(rng, "c" in persons)
        gold = [_document(s1.format(a=a, b=b), rng, prose), _document(s2.format(b=b, c=c), rng, prose)]
        question, answer = q.format(a=a), c
    names.protect = False
    depths = [rng.random() for _ in gold]

    def distractor(r: random.Random) -> str:
        # documents of the same kinds as the gold ones, about other (invented) entities
        if r.random() < 0.5:
            fi = r.randrange(len(_FACTS))
            body = _FACTS[fi][0].format(a=subject(r, fi in _PERSON_FACTS), b=names(r))
        else:
            ci = r.randrange(len(_CHAINS))
            persons = _PERSON_CHAINS[ci]
            body = _CHAINS[ci][r.randrange(2)].format(
                a=subject(r, "a" in persons), b=names(r), c=subject(r, "c" in persons)
            )
        return _document(body, r, prose)

    stream = hs.UnitStream(distractor, f"{task}:{seed}")
    instruction = (
        "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    )
    head = f"{instruction}\n\nThe following are given documents.\n\n"

    def build(n: int) -> _Built:
        docs = stream.take(n)
        order: dict[int, list[int]] = {}
        for gi, d in enumerate(depths):
            order.setdefault(round(d * n), []).append(gi)
        pieces: list[tuple[str, bool]] = []
        for i in range(n + 1):
            pieces.extend((gold[gi], True) for gi in order.get(i, ()))
            if i < n:
                pieces.append((docs[i], False))
        parts, spans, pos = [head], [], len(head)
        for j, (text, relevant) in enumerate(pieces):
            doc = f"Document {j + 1}:\n{text}"
            if j:
                parts.append("\n\n")
                pos += 2
            if relevant:
                spans.append((pos, pos + len(doc)))
            parts.append(doc)
            pos += len(doc)
        return _Built("".join(parts), spans)

    return _Spec(f"{instruction}\n\nQuestion: {question}", "Answer:", [answer], 32, "string_match_part", build)


# ------------------------------------------------------------------------------------------------ API


def generate(
    task: str,
    length: int,
    seed: int,
    count_tokens: CountTokens,
    template_overhead: int = 0,
) -> Sample:
    """Generate one RULER sample whose context, measured with ``count_tokens``, fills ``length`` tokens.

    ``template_overhead`` is the number of tokens the chat template, question and answer prefix add; the
    context is grown until ``count_tokens(context) + template_overhead`` is as large as possible but
    ``<= length``. Deterministic for a given ``(task, length, seed)`` (and tokenizer). Raises ValueError for
    unknown tasks and for lengths too small to hold the needles.
    """
    _check_task(task)
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    if task.startswith("niah_"):
        spec = _niah(task, seed)
    elif task == "vt":
        spec = _vt(task, seed)
    elif task == "cwe":
        spec = _cwe(task, seed, length, count_tokens, template_overhead)
    elif task == "fwe":
        spec = _fwe(task, seed)
    else:
        spec = _qa(task, seed)
    n = fit_units(
        lambda k: spec.build(k).context,
        length,
        count_tokens,
        template_overhead,
        what=f"RULER task {task!r}",
        max_units=spec.max_units,
    )
    built = spec.build(n)
    return Sample(
        id=f"{task}-{length}-{seed}",
        task=task,
        context=built.context,
        question=spec.question,
        answer_prefix=spec.answer_prefix,
        answers=list(built.answers if built.answers is not None else spec.answers),
        max_new_tokens=spec.max_new_tokens,
        length=length,
        seed=seed,
        metric=spec.metric,
        spans=built.spans,
        stop=list(spec.stop),
    )


def generate_many(
    tasks: str | Iterable[str],
    length: int,
    n: int,
    seed: int,
    count_tokens: CountTokens,
    template_overhead: int | Mapping[str, int] = 0,
) -> Iterator[Sample]:
    """For each task, ``n`` samples with seeds ``seed, seed + 1, ..., seed + n - 1``.

    ``template_overhead`` may be one number or a per-task mapping (questions differ in length).
    Task names are checked before anything is generated.
    """
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    for t in names:
        _check_task(t)
    if isinstance(template_overhead, Mapping):
        missing = [t for t in names if t not in template_overhead]
        if missing:
            raise ValueError(f"template_overhead has no entry for task(s): {', '.join(missing)}")
    for t in names:
        overhead = template_overhead[t] if isinstance(template_overhead, Mapping) else template_overhead
        for i in range(n):
            yield generate(t, length, seed + i, count_tokens, overhead)
