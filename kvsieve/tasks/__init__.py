"""Evaluation tasks: RULER-style generators, a LongBench loader, and metrics.

``Sample`` keeps context and question apart (the context is compressed before the question is seen).
"""

from kvsieve.tasks.longbench import load_longbench
from kvsieve.tasks.metrics import METRICS, score
from kvsieve.tasks.ruler import TASKS, generate, generate_many, task_family
from kvsieve.tasks.sample import Sample, read_jsonl, write_jsonl

__all__ = [
    "METRICS",
    "TASKS",
    "Sample",
    "generate",
    "generate_many",
    "load_longbench",
    "read_jsonl",
    "score",
    "task_family",
    "write_jsonl",
]
