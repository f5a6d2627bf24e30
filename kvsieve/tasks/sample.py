"""One evaluation example, and its JSONL storage.

A :class:`Sample` keeps the context and the question apart on purpose: kvsieve compresses the KV
cache of the context *before* the question is seen (query-agnostic prefill compression), so the
question must never be folded into ``context``. The prompt builder renders
``context`` -> (compress) -> ``question`` + ``answer_prefix`` -> generate.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["Sample", "write_jsonl", "read_jsonl"]

_REQUIRED = (
    "id",
    "task",
    "context",
    "question",
    "answer_prefix",
    "answers",
    "max_new_tokens",
    "length",
    "seed",
    "metric",
)
_OPTIONAL = ("spans", "stop")


@dataclass
class Sample:
    """One example: a context to compress, a question asked after compression, and reference answers.

    ``spans`` are character spans ``[start, end)`` into ``context`` that the answer depends on (needle
    sentences, chain statements, gold documents); empty where that is not meaningful. ``length`` is the
    target length in tokens the sample was generated for (for loaded datasets: the dataset's own length
    field). ``metric`` names an entry of :data:`kvsieve.tasks.metrics.METRICS`.
    """

    id: str
    task: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int
    length: int
    seed: int
    metric: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_types(self.__dict__)
        self.answers = list(self.answers)
        self.stop = list(self.stop)
        self.spans = [(int(s), int(e)) for s, e in self.spans]
        for start, end in self.spans:
            if not 0 <= start <= end <= len(self.context):
                raise ValueError(
                    f"Sample {self.id!r}: span ({start}, {end}) lies outside the context (length {len(self.context)})"
                )
        if self.max_new_tokens <= 0:
            raise ValueError(f"Sample {self.id!r}: field 'max_new_tokens' must be positive, got {self.max_new_tokens}")

    def span_texts(self) -> list[str]:
        """The context text of every span, in order."""
        return [self.context[s:e] for s, e in self.spans]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (spans become ``[start, end]`` lists)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["answers"] = list(self.answers)
        out["spans"] = [[s, e] for s, e in self.spans]
        out["stop"] = list(self.stop)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Sample:
        """Build a Sample from a dict as written by :meth:`to_dict`; unknown keys are ignored.

        Raises ValueError naming the first missing or ill-typed field.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a Sample must be a JSON object, got {type(data).__name__}")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"Sample is missing required field(s): {', '.join(missing)}")
        kwargs = {k: data[k] for k in _REQUIRED}
        for k in _OPTIONAL:
            if k in data:
                kwargs[k] = data[k]
        spans = kwargs.get("spans", [])
        if not isinstance(spans, list | tuple) or not all(
            isinstance(sp, list | tuple) and len(sp) == 2 and all(_is_int(x) for x in sp) for sp in spans
        ):
            raise ValueError(f"Sample field 'spans' must be a list of [start, end] integer pairs, got {spans!r:.80}")
        _check_types(kwargs)
        return cls(**kwargs)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_types(d: dict[str, Any]) -> None:
    for name in ("id", "task", "context", "question", "answer_prefix", "metric"):
        if name in d and not isinstance(d[name], str):
            raise ValueError(f"Sample field {name!r} must be a string, got {type(d[name]).__name__}")
    for name in ("max_new_tokens", "length", "seed"):
        if name in d and not _is_int(d[name]):
            raise ValueError(f"Sample field {name!r} must be an integer, got {type(d[name]).__name__}")
    for name in ("answers", "stop"):
        if name in d:
            v = d[name]
            if isinstance(v, str) or not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
                raise ValueError(f"Sample field {name!r} must be a list of strings, got {v!r:.80}")


def write_jsonl(samples: Iterable[Sample], path: str | Path) -> int:
    """Write samples as one JSON object per line (the folder made if missing); returns how many were written."""
    n = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for sample in samples:
            fh.write(json.dumps(sample.to_dict(), ensure_ascii=False))
            fh.write("\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[Sample]:
    """Read samples written by :func:`write_jsonl`. Blank lines are skipped.

    Raises ValueError with the file and line number on bad JSON or an invalid sample.
    """
    out: list[Sample] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from exc
            try:
                out.append(Sample.from_dict(data))
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
    return out
