"""Which samples a run reads, and reading them: one small spec every config can produce.

A :class:`SampleSpec` names generated RULER-style samples (tasks x lengths x samples from a seed) or a
data file (``kvsieve generate`` JSONL or LongBench); :func:`load_samples` yields them in sample-major
order, so an interrupted run leaves every task with about the same number of samples. Grids,
evolution's dev and held-out sets and training all load through here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvsieve.prompt import build_prompt
from kvsieve.tasks import fact_list, ruler, ruler_alt
from kvsieve.tasks.longbench import load_longbench
from kvsieve.tasks.sample import Sample, read_jsonl

__all__ = ["SampleSpec", "ALL_TASKS", "generator_for", "load_samples", "read_samples", "template_overhead",
           "DEFAULT_SAMPLES"]

DEFAULT_SAMPLES = 5  # generated samples per task and length when a spec does not say
# every generated task: the first layout's names (ruler.py), then the second, independently written
# layout's (ruler_alt.py, ``fmt2:...``), so no policy is tuned to one layout; then the long-output task (fact_list.py)
ALL_TASKS: tuple[str, ...] = tuple(ruler.TASKS) + tuple(ruler_alt.TASKS) + tuple(fact_list.TASKS)


def generator_for(task: str):
    """The generator of a task name: ``fmt2:...`` from the second layout, ``fact_list`` the long-output task's,
    the rest from the first."""
    if fact_list.is_fact_list_task(task):
        return fact_list.generate
    return ruler_alt.generate if ruler_alt.is_alt_task(task) else ruler.generate


@dataclass
class SampleSpec:
    """Generated samples (``tasks`` x ``lengths`` x ``samples`` from ``seed``) or every sample of ``data``
    (the first ``samples`` of it when given). ``model`` names whose tokenizer measures the lengths."""

    model: str = ""
    tasks: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    samples: int | None = None
    seed: int = 0
    data: str | None = None


def template_overhead(tokenizer, task: str, seed: int) -> int:
    """Tokens the chat template, question and answer prefix add around a task's context."""

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    sample = generator_for(task)(task, 2048, seed, count)
    prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    total = prompt.context_ids.shape[1] + prompt.question_ids.shape[1]
    return total - count(sample.context) + 8  # margin: keys differ in length between seeds


def read_samples(path: str) -> list[Sample]:
    """Samples from a JSONL file: the format ``kvsieve generate`` writes, or LongBench's."""
    with open(path, encoding="utf-8") as fh:
        first = next((line for line in fh if line.strip()), "")
    if not first:
        raise ValueError(f"{path} holds no samples")
    try:
        record = json.loads(first)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:1 is not JSON: {err}") from err
    samples = load_longbench(path) if "question" not in record and "input" in record else read_jsonl(path)
    # the store keys a row by (task, length, sample id): two samples sharing one would share a row
    seen: dict[tuple, int] = {}
    for sample in samples:
        key = (sample.task, sample.length, sample.id)
        seen[key] = seen.get(key, 0) + 1
    repeated = [f"{task}/{length}/{sid!r} x{n}" for (task, length, sid), n in seen.items() if n > 1]
    if repeated:
        raise ValueError(f"{path}: sample ids must be unique per task and length; repeated: "
                         f"{', '.join(repeated[:5])}{' ...' if len(repeated) > 5 else ''}")
    return samples


def load_samples(spec: SampleSpec, tokenizer) -> Iterator[Sample]:
    """The samples ``spec`` names; generated ones need the model's ``tokenizer`` (``None`` for a data file)."""
    if spec.data:
        yield from read_samples(spec.data)[: spec.samples]  # None: every sample of the file
        return

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    # Sample-major order: an interrupted run leaves every task with about the same number of samples.
    overhead = {task: template_overhead(tokenizer, task, spec.seed) for task in spec.tasks}
    for length in spec.lengths:
        for i in range(DEFAULT_SAMPLES if spec.samples is None else spec.samples):
            for task in spec.tasks:
                yield generator_for(task)(task, length, spec.seed + i, count, overhead[task])
