"""Check a grid before any work starts, and produce its samples."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from kvsieve.models import context_length
from kvsieve.policies import get as get_policy
from kvsieve.policies import parse_spec
from kvsieve.selection import Budget
from kvsieve.tasks import TASKS, Sample, generate, generate_many, load_longbench, read_jsonl

__all__ = ["validate", "load_samples", "read_samples", "template_overhead", "DEFAULT_SAMPLES"]

DEFAULT_SAMPLES = 5  # generated samples per task and length when the grid does not say


def validate(config) -> None:
    """Raise ValueError naming the bad value; nothing is loaded or computed."""
    if not config.policies and not config.qa_policies:
        raise ValueError("the grid is empty: give at least one policy")
    for spec in [*config.policies, *config.qa_policies]:
        name, params = parse_spec(spec)
        if name != "oracle":
            get_policy(name, **params)  # unknown names and parameters raise here
        elif config.data:
            raise ValueError("the oracle reference needs generated samples with answer spans, not --data")
    compressing = [s for s in [*config.policies, *config.qa_policies] if parse_spec(s)[0] != "full"]
    if compressing and not config.ratios:
        raise ValueError("the grid is empty: give at least one compression ratio")
    for ratio in config.ratios:
        Budget(ratio=ratio)
    if config.mode not in ("prefill", "decode"):
        raise ValueError(f"mode {config.mode!r} is not one of 'prefill', 'decode'")
    if config.mode == "decode":
        chunk = config.chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk!r}")
        if config.question_aware or config.qa_policies:
            raise ValueError("question-aware cells read the question with the context, which decode-time eviction "
                             "has already evicted from: use mode 'prefill' for them")
        for spec in config.policies:
            name, params = parse_spec(spec)
            if name == "oracle" or (name != "full" and get_policy(name, **params).needs_reconstruction):
                raise ValueError(f"policy {spec!r} cannot evict in decode mode (it needs the whole context after "
                                 "the prefill); use mode 'prefill' for it")
    if config.samples is not None and (isinstance(config.samples, bool) or not isinstance(config.samples, int)
                                       or config.samples < 1):
        raise ValueError(f"samples must be an int >= 1 (or unset), got {config.samples!r}")
    if config.data:
        if not Path(config.data).is_file():
            raise ValueError(f"data file {config.data} does not exist")
        return
    if not config.tasks:
        raise ValueError("the grid is empty: give at least one task")
    unknown = [t for t in config.tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(map(repr, unknown))}; available: {', '.join(TASKS)}")
    if not config.lengths:
        raise ValueError("the grid is empty: give at least one length")
    limit = context_length(config.model)
    for length in config.lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise ValueError(f"length must be a positive int, got {length!r}")
        if limit is not None and length > limit:
            raise ValueError(f"length {length} is above the context of {config.model} ({limit} tokens)")


def template_overhead(tokenizer, task: str, seed: int) -> int:
    """Tokens the chat template, question and answer prefix add around a task's context."""
    from kvsieve.engine.generate import build_prompt

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    sample = next(generate_many([task], 2048, 1, seed, count))
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
    if "question" not in record and "input" in record:
        return load_longbench(path)
    return read_jsonl(path)


def load_samples(config, tokenizer) -> Iterator[Sample]:
    if config.data:
        yield from read_samples(config.data)[: config.samples]  # None: every sample of the file
        return

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    # Sample-major order: an interrupted run leaves every task with about the same number of samples.
    overhead = {task: template_overhead(tokenizer, task, config.seed) for task in config.tasks}
    for length in config.lengths:
        for i in range(DEFAULT_SAMPLES if config.samples is None else config.samples):
            for task in config.tasks:
                yield generate(task, length, config.seed + i, count, overhead[task])
