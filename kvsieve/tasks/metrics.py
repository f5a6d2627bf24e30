"""Scoring: RULER's string matching and LongBench's metrics, every one returning a float in [0, 100].

Every metric has the signature ``metric(prediction, answers) -> float`` and, where a task has several
reference answers, scores against the best one (LongBench: max over ground truths; RULER
``string_match_all``: mean over references, since all of them are required).

Sources: RULER (NVIDIA RULER, arXiv 2404.06654), scripts/eval/synthetic/constants.py; LongBench
(arXiv 2308.14508), metrics.py and eval.py. Everything below is reimplemented here from those
definitions. Simplifications versus LongBench, by design:

* ``classification``: LongBench credits ``1 / |classes named in the prediction|`` when the gold class is
  among them, which needs the dataset's ``all_classes``. :class:`~kvsieve.tasks.sample.Sample` has no such
  field, so with ``all_classes=None`` the classes are taken to be the references only: full credit when the
  prediction's first line names a reference. Pass ``all_classes`` to get LongBench's exact rule.
* ``rouge_l``: sentence-level ROUGE-L F1 (beta = 1) over lowercased word tokens, computed here, where
  LongBench calls the ``rouge`` package (whose tokenizer differs slightly).
* ``code_sim``: LongBench uses ``fuzz.ratio`` (normalized indel similarity); it is computed here with our
  own edit distance (substitutions cost 2, i.e. insertions/deletions only), no extra dependency.
* English only (no Chinese tokenization, so no qa_f1_zh / rouge_zh).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

__all__ = [
    "METRICS",
    "score",
    "settled",
    "MONOTONE",
    "string_match_all",
    "string_match_part",
    "qa_f1",
    "rouge_l",
    "classification",
    "retrieval",
    "count",
    "code_sim",
    "normalize_answer",
    "levenshtein",
    "edit_similarity",
]

Metric = Callable[[str, list[str]], float]


def _refs(answers: Sequence[str]) -> list[str]:
    if isinstance(answers, str):
        answers = [answers]
    refs = list(answers)
    if not refs:
        raise ValueError("answers must contain at least one reference")
    return refs


# --------------------------------------------------------------------------------------------- RULER


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER: the share of references found (case-insensitive substring) in the prediction, x100."""
    refs = _refs(answers)
    pred = prediction.lower()
    return 100.0 * sum(r.lower() in pred for r in refs) / len(refs)


def string_match_part(prediction: str, answers: list[str]) -> float:
    """RULER: 100 if any reference occurs (case-insensitive substring) in the prediction, else 0."""
    pred = prediction.lower()
    return 100.0 * max(float(r.lower() in pred) for r in _refs(answers))


# ---------------------------------------------------------------------------------------- LongBench


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD/LongBench English normalization: lowercase, drop punctuation, drop articles, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: list[str]) -> float:
    """Token F1 between normalized prediction and reference, max over references, x100."""
    pred = normalize_answer(prediction).split()
    return 100.0 * max(_f1(pred, normalize_answer(r).split()) for r in _refs(answers))


_WORD = re.compile(r"\w+")


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, start=1):
            cur[j] = prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1])
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, answers: list[str]) -> float:
    """ROUGE-L F1 (LCS of lowercased word tokens, beta = 1), max over references, x100."""
    pred = _WORD.findall(prediction.lower())
    best = 0.0
    for ref in _refs(answers):
        toks = _WORD.findall(ref.lower())
        if not pred or not toks:
            continue
        lcs = _lcs_length(pred, toks)
        if lcs:
            p, r = lcs / len(pred), lcs / len(toks)
            best = max(best, 2 * p * r / (p + r))
    return 100.0 * best


def _first_line(prediction: str) -> str:
    # LongBench eval.py keeps only the first line for trec, triviaqa, samsum and lsht
    return prediction.lstrip("\n").split("\n")[0]


def classification(prediction: str, answers: list[str], all_classes: Sequence[str] | None = None) -> float:
    """LongBench classification score on the prediction's first line, max over references, x100.

    With ``all_classes``: the classes named in the prediction are collected, classes that are mere substrings
    of the reference are dropped, and the score is ``1 / len(named)`` if the reference is named, else 0.
    Without it (the Sample has no class list), the references stand in for the class list.
    """
    refs = _refs(answers)
    pred = _first_line(prediction)
    classes = list(all_classes) if all_classes is not None else refs
    best = 0.0
    for ref in refs:
        named = [c for c in classes if c in pred]
        named = [c for c in named if not (c in ref and c != ref)]
        if ref in named:
            best = max(best, 1.0 / len(named))
    return 100.0 * best


def retrieval(prediction: str, answers: list[str]) -> float:
    """LongBench passage retrieval: the share of numbers in the prediction equal to the gold paragraph id.

    The reference looks like 'Paragraph 3' (the number alone is accepted too).
    """
    numbers = re.findall(r"\d+", prediction)
    best = 0.0
    for ref in _refs(answers):
        ids = re.findall(r"Paragraph (\d+)", ref) or re.findall(r"\d+", ref)
        if not ids or not numbers:
            continue
        best = max(best, sum(n == ids[0] for n in numbers) / len(numbers))
    return 100.0 * best


def count(prediction: str, answers: list[str]) -> float:
    """LongBench passage count: the share of numbers in the prediction equal to the reference count."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return 100.0 * max(sum(n == str(r).strip() for n in numbers) / len(numbers) for r in _refs(answers))


def levenshtein(a: str, b: str, substitution_cost: int = 1) -> int:
    """Edit distance between ``a`` and ``b`` (insert/delete cost 1, substitution ``substitution_cost``)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (0 if x == y else substitution_cost))
        prev = cur
    return prev[-1]


def edit_similarity(a: str, b: str) -> float:
    """Normalized indel similarity in [0, 1], as ``fuzz.ratio`` / ``Levenshtein.ratio`` define it:
    ``(len(a) + len(b) - d) / (len(a) + len(b))`` with d the edit distance where substitutions cost 2.
    """
    total = len(a) + len(b)
    if total == 0:
        return 1.0
    return (total - levenshtein(a, b, substitution_cost=2)) / total


def _first_code_line(prediction: str) -> str:
    # LongBench code_sim_score: the first line that is not a comment or a markdown fence
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(prediction: str, answers: list[str]) -> float:
    """LongBench code similarity: edit similarity of the first non-comment line to the reference, x100."""
    line = _first_code_line(prediction)
    return 100.0 * max(edit_similarity(line, r) if (line or r) else 0.0 for r in _refs(answers))


METRICS: dict[str, Metric] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "rouge_l": rouge_l,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
}


# metrics that can only grow as the prediction is extended (a reference found stays found): once such a metric
# scores 100, no further token can change it
MONOTONE = frozenset({"string_match_all", "string_match_part"})


def settled(metric_name: str, prediction: str, answers: list[str]) -> bool:
    """Whether decoding further cannot change ``prediction``'s score: a monotone metric (``MONOTONE``) already at
    100. A caller that needs only the score may stop there (evolution's stage 3 does; the harness stores whole
    predictions and does not)."""
    return metric_name in MONOTONE and score(metric_name, prediction, answers) >= 100.0


def score(metric_name: str, prediction: str, answers: list[str]) -> float:
    """Score ``prediction`` against ``answers`` with the named metric; a float in [0, 100]."""
    try:
        fn = METRICS[metric_name]
    except KeyError:
        raise ValueError(f"unknown metric {metric_name!r}; allowed: {', '.join(sorted(METRICS))}") from None
    return float(fn(prediction, answers))
