"""Load LongBench (arXiv 2308.14508) JSONL files as :class:`~kvsieve.tasks.sample.Sample` objects.

A LongBench line has the fields ``input`` (the question; empty for some tasks), ``context``, ``answers``,
``length`` (word count), ``dataset``, ``language``, ``all_classes`` and ``_id``. Mapping:

* ``context`` -> ``Sample.context`` (compressed before the question is seen);
* ``question`` = a short task instruction written for kvsieve, then the ``input`` field. LongBench's own
  per-dataset prompt templates are not reproduced; the instruction exists because several datasets
  (gov_report, multi_news, passage_count, lcc) have an empty ``input``;
* ``metric`` and ``max_new_tokens`` per dataset follow LongBench's dataset2metric and dataset2maxlen;
* ``all_classes`` is not kept (see :func:`kvsieve.tasks.metrics.classification`);
* LongBench-E files (dataset names ending in ``_e``) map like their base dataset.

Only the English datasets are supported (the Chinese ones need Chinese-aware metrics).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvsieve.tasks.sample import Sample

__all__ = ["DATASET_METRIC", "DATASET_MAXLEN", "load_longbench", "sample_from_record"]

# LongBench eval.py dataset2metric (English datasets), with our metric names
DATASET_METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "gov_report": "rouge_l",
    "qmsum": "rouge_l",
    "multi_news": "rouge_l",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge_l",
    "passage_retrieval_en": "retrieval",
    "passage_count": "count",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

# LongBench config/dataset2maxlen.json (English datasets)
DATASET_MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_retrieval_en": 32,
    "passage_count": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# Our own short instructions (asked after the context), and the answer prefix per kind of task.
_QA = (
    "Answer the question based on the text above. Only give me the answer and do not output any other words.",
    "Answer:",
)
_INSTRUCTIONS: dict[str, tuple[str, str]] = {
    "narrativeqa": (
        "Answer the question about the story above as concisely as you can, in a single phrase.",
        "Answer:",
    ),
    "qasper": (
        "Answer the question about the article above as concisely as you can, in a single phrase or sentence. "
        'If it cannot be answered, write "unanswerable"; if it is a yes/no question, answer "yes", "no" or '
        '"unanswerable".',
        "Answer:",
    ),
    "multifieldqa_en": _QA,
    "hotpotqa": _QA,
    "2wikimqa": _QA,
    "musique": _QA,
    "triviaqa": ("Answer the question in the same format as the examples above.", "Answer:"),
    "gov_report": ("Write a one-page summary of the report above.", "Summary:"),
    "qmsum": ("Answer the query about the meeting transcript above in one or more sentences.", "Answer:"),
    "multi_news": ("Write a one-page summary of all the news above.", "Summary:"),
    "samsum": ("Summarize the dialogue in the same format as the examples above.", "Summary:"),
    "trec": ("Determine the type of the question, in the same format as the examples above.", "Type:"),
    "passage_retrieval_en": (
        "Which of the paragraphs above does the following abstract come from? Answer in the format "
        '"Paragraph 1", "Paragraph 2", and so on.',
        "The answer is:",
    ),
    "passage_count": (
        "How many unique paragraphs are there in the text above, after removing duplicates? "
        "Give only the final count as a number.",
        "The final answer is:",
    ),
    "lcc": ("Complete the next line of the code above.", ""),
    "repobench-p": ("Complete the next line of the code above.", ""),
}

_REQUIRED = ("input", "context", "answers", "length", "dataset", "_id")


def _base(dataset: str) -> str:
    return dataset[:-2] if dataset.endswith("_e") and dataset[:-2] in DATASET_METRIC else dataset


def sample_from_record(record: Any, where: str = "record") -> Sample:
    """Turn one LongBench record (a dict) into a Sample; ValueError naming ``where`` and the bad field."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in _REQUIRED if k not in record]
    if missing:
        raise ValueError(f"{where}: missing LongBench field(s): {', '.join(missing)}")
    dataset = record["dataset"]
    if not isinstance(dataset, str) or _base(dataset) not in DATASET_METRIC:
        raise ValueError(
            f"{where}: unsupported dataset {dataset!r}; supported: {', '.join(DATASET_METRIC)} (and their _e variants)"
        )
    base = _base(dataset)
    for name in ("input", "context", "_id"):
        if not isinstance(record[name], str):
            raise ValueError(f"{where}: field {name!r} must be a string, got {type(record[name]).__name__}")
    answers = record["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str | int) for a in answers):
        raise ValueError(f"{where}: field 'answers' must be a non-empty list of strings, got {answers!r:.80}")
    length = record["length"]
    if isinstance(length, bool) or not isinstance(length, int | float):
        raise ValueError(f"{where}: field 'length' must be a number, got {length!r:.40}")
    instruction, prefix = _INSTRUCTIONS[base]
    question = f"{instruction}\n\n{record['input']}".rstrip() if record["input"].strip() else instruction
    return Sample(
        id=record["_id"],
        task=base,
        context=record["context"],
        question=question,
        answer_prefix=prefix,
        answers=[str(a) for a in answers],
        max_new_tokens=DATASET_MAXLEN[base],
        length=int(length),
        seed=0,
        metric=DATASET_METRIC[base],
    )


def load_longbench(path: str | Path) -> list[Sample]:
    """Read a LongBench-format JSONL file. Blank lines are skipped; errors name the file and line."""
    out: list[Sample] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON: {exc.msg}") from exc
            out.append(sample_from_record(record, where))
    return out
