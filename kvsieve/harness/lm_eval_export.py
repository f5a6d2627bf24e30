"""lm-eval's requests as kvsieve samples: one request's sample (:func:`sample_for`, which the backend answers too),
and whole tasks written as JSONL (:func:`export_samples`).

**Many policies at once** (``kvsieve-lm-eval export``, :func:`export_samples`):
lm-eval's requests written as kvsieve samples (JSONL), with the same task names, lengths and sample ids as the
backend's rows, so ``kvsieve eval --data FILE`` scores every (policy, ratio) with one prefill per request
and fills the same store the backend reads and writes (the backend then reuses those rows).
"""

from __future__ import annotations

import hashlib
import importlib
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval.tasks import TaskManager

from kvsieve.bundled import canonical_name
from kvsieve.harness.prompt_split import Split, split_prompt
from kvsieve.models import local_source
from kvsieve.tasks.sample import Sample, write_jsonl

__all__ = ["METRIC", "SHORT_SHARE", "TASK_PREFIX", "export_samples", "length_lines", "reference_answers",
           "ruler_metadata", "sample_for"]

RULER_GENERATORS = tuple(f"lm_eval.tasks.ruler.{name}" for name in
                         ("common_utils", "prepare_niah", "niah_utils", "vt_utils", "cwe_utils", "fwe_utils"))
LM_EVAL_RANDOM_SEED, LM_EVAL_NUMPY_SEED = 0, 1234  # simple_evaluate's defaults (random_seed, numpy_random_seed)
TASK_PREFIX = "lmeval:"  # rows of lm-eval's tasks never share a table with kvsieve's own generator's
METRIC = "string_match_all"  # RULER's metric, as lm-eval's ruler tasks score it (x100 here)


def reference_answers(doc: dict) -> list[str] | None:
    """RULER's reference answers (``outputs``), or None where the document carries none."""
    outputs = doc.get("outputs") if isinstance(doc, dict) else None
    if isinstance(outputs, str):
        outputs = [outputs]
    if isinstance(outputs, list) and outputs and all(isinstance(o, str) and o for o in outputs):
        return outputs
    return None


def sample_for(prompt: str, gen_kwargs: dict, doc: dict, task: str, doc_id: int | None, qa: str = "auto",
               length: int = 0) -> tuple[Sample, Split]:
    """The kvsieve sample of one lm-eval request (its row's task, length and id), and how its prompt was split.
    A document without reference answers gets a placeholder one (its score means nothing; no row is stored)."""
    split = split_prompt(prompt, doc.get("gen_prefix") if isinstance(doc, dict) else None, qa)
    until = gen_kwargs.get("until") or []
    stop = [until] if isinstance(until, str) else [s for s in until if s]
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:12]
    sample = Sample(id=f"{doc_id}-{digest}", task=TASK_PREFIX + task, context=split.context, question=split.question,
                    answer_prefix=split.answer_prefix, answers=reference_answers(doc) or ["-"],
                    max_new_tokens=int(gen_kwargs.get("max_gen_toks", 256)),
                    length=int(doc.get("max_length") or length), seed=0, metric=METRIC, stop=stop)
    return sample, split


def export_samples(model: str, tasks: Sequence[str], lengths: Sequence[int], limit: int, out: str | Path,
                   include_path: str | None = None, skip: int = 0) -> int:
    """Write lm-eval's first ``limit`` requests of each task (RULER built at ``lengths`` with ``model``'s tokenizer)
    after its first ``skip`` as kvsieve samples to ``out`` (JSONL), request-major (the first request of every task,
    then the second, ...), so an interrupted ``kvsieve eval --data`` leaves every task with about as many requests.
    Returns the number written. ``skip`` draws requests no earlier export of the first ``skip`` has shown: a fresh
    test set after a rule was fixed on (or its rows read from) the first ones.

    Only prompts the rule splits query-agnostically, with reference answers, are written: ``kvsieve eval`` runs a
    file's samples in one mode, and scores them against their answers. Others raise ``ValueError``.
    ``include_path``: a folder of further task YAMLs (lm-eval's ``--include_path``).

    RULER's generators draw from Python's and numpy's global generators, which only ``simple_evaluate`` seeds,
    and importing them draws too: they are imported first, then each task is built after seeding both as
    lm-eval's defaults do (``random`` 0, numpy 1234). A task's samples are then the same whatever other tasks
    are listed, and a larger ``limit`` extends a smaller one's file."""
    if limit < 1 or skip < 0:
        raise ValueError(f"limit must be >= 1 and skip >= 0 requests a task; got limit={limit}, skip={skip}")
    for module in RULER_GENERATORS:
        importlib.import_module(module)
    manager = _task_manager(include_path, model, tuple(int(n) for n in lengths))
    per_task = []
    for requested in tasks:
        random.seed(LM_EVAL_RANDOM_SEED)
        np.random.seed(LM_EVAL_NUMPY_SEED)
        for name, task in manager.load([requested])["tasks"].items():
            per_task.append(_task_samples(name, task, limit, skip))
    ordered = [s for i in range(max(map(len, per_task), default=0)) for samples in per_task
               if i < len(samples) for s in [samples[i]]]
    return write_jsonl(ordered, out)


@lru_cache(maxsize=4)
def _task_manager(include_path: str | None, model: str, lengths: tuple[int, ...]) -> TaskManager:
    # indexing lm-eval's ~15k task configs takes ~12 s; a process exporting again reuses the index (tasks are
    # still built afresh by each ``load``, after the seeding above)
    return TaskManager(include_path=include_path, metadata=ruler_metadata(model, lengths))


def _task_samples(name: str, task: Any, limit: int, skip: int) -> list[Sample]:
    task.build_all_requests(limit=skip + limit)  # the same generator draws as a plain export of skip + limit
    samples = []
    for instance in task.instances[skip:]:
        prompt, gen_kwargs = instance.args
        sample, split = sample_for(prompt, dict(gen_kwargs), instance.doc, name, instance.doc_id)
        if split.question_aware or reference_answers(instance.doc) is None:
            raise ValueError(f"{name} document {instance.doc_id}: "
                             f"{split.rule if split.question_aware else 'no reference answers (outputs)'}; "
                             "run this task through the backend (kvsieve-lm-eval) instead")
        samples.append(sample)
    return samples


SHORT_SHARE = 0.75  # a request under this share of its nominal length is named at export


def length_lines(samples: Sequence[Sample], count_tokens: Callable[[str], int]) -> list[str]:
    """One line per task: the tokens of context + question (min-max) and how many requests fall under
    :data:`SHORT_SHARE` of their nominal length. lm-eval's generators build some far shorter than asked
    (multikey_3 at ~2k of 4096 now and then; cwe at ~2.6k always), which a results table would not show."""
    by_task: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for sample in samples:
        by_task[sample.task].append((count_tokens(sample.context + sample.question), int(sample.length)))
    lines = []
    for task, counts in by_task.items():
        tokens = [n for n, _ in counts]
        short = sum(n < SHORT_SHARE * nominal for n, nominal in counts)
        lines.append(f"{task}: {min(tokens)}-{max(tokens)} tokens (context + question)"
                     + (f"; {short} of {len(counts)} under {SHORT_SHARE:.0%} of their nominal length" if short else ""))
    return lines


def ruler_metadata(model: str, lengths: Sequence[int]) -> dict[str, Any]:
    """lm-eval ``metadata`` for its RULER tasks: the lengths, and the model's own tokenizer files (a bundled
    model's converted folder), so the generators size the samples offline with the tokenizer that reads them."""
    return {"tokenizer": local_source(canonical_name(model)), "max_seq_lengths": [int(n) for n in lengths]}
