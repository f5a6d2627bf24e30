"""Check a grid before any work starts, and produce its samples."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from kvsieve.models import check_length
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
        elif config.data and Path(config.data).is_file():
            no_spans = [s.id for s in read_samples(config.data)[: config.samples] if not s.spans]
            if no_spans:
                raise ValueError(f"the oracle reference keeps the answer's spans, and {len(no_spans)} sample(s) of "
                                 f"{config.data} carry none (e.g. {no_spans[0]!r}); give a file whose samples have "
                                 "'spans' (kvsieve generate writes them) or drop oracle")
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
    for length in config.lengths:
        check_length(config.model, length)


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
