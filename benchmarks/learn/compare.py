"""Held-out KL of trained checkpoints against their warm start, paired over requests.

The test the stopping rule never saw: requests generated from ``--seed`` (default 3000: disjoint from training's
5000+ and the stopping rule's 6000+), each an episode as training builds it. Per request the context's full
cache is computed once; every (policy, ratio) prunes a copy of it in prefill mode (``compress_cache``, as a
training rollout does), the continuation is read on it, and the mean KL(full || compressed) per continuation
token is kept (teacher: its top 256 tokens and a rest bin, as in training). Printed per ratio: each policy's mean
KL, each policy minus the first (the warm start) with a paired percentile-bootstrap 95% interval over requests, and
``mean of the others``: per request the mean over every policy after the first (replicated runs), minus the first.
``--out`` keeps the per-request values as CSV.

    python benchmarks/learn/compare.py --model smollm2-135m-instruct --length 1024 --samples 3 --seed 3000 \\
        --policies "kvzap(checkpoint='smollm2-135m-instruct'),kvzap(checkpoint='runs/a'),kvzap(checkpoint='runs/b')"
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from kvsieve.engine.cache import clone_cache
from kvsieve.engine.compress import compress_cache
from kvsieve.learn.heldout import paired_interval
from kvsieve.learn.reward import kl_per_position
from kvsieve.learn.rollout import Episode, context_cache_for, continuation_logits, teacher_for
from kvsieve.learn.train_config import episodes_from_samples
from kvsieve.models import load
from kvsieve.policies import from_spec, split_specs
from kvsieve.selection import Budget
from kvsieve.tasks.load import SampleSpec, load_samples

__all__ = ["heldout_kl", "table"]


@torch.no_grad()
def heldout_kl(model, episodes: list[Episode], specs: list[str], ratios: list[float], window: int = 32,
               top_k: int | None = 256, progress: bool = True) -> list[dict]:
    """Rows ``{episode, policy, ratio, kl}``: every policy at every ratio on every episode."""
    policies = {spec: from_spec(spec) for spec in specs}
    rows = []
    for i, episode in enumerate(episodes):
        context = context_cache_for(model, episode, window)
        teacher = teacher_for(model, episode, "prefill", window, 1, top_k, context)
        for spec, policy in policies.items():
            for ratio in ratios:
                cache = clone_cache(context)
                compress_cache(cache, policy, Budget(kept=Budget(ratio=ratio).resolve(episode.context.shape[1])))
                logits = continuation_logits(model, cache, episode, window)
                rows.append({"episode": episode.name or str(i), "policy": spec, "ratio": ratio,
                             "kl": float(kl_per_position(teacher, logits).mean())})
        if progress:
            print(f"request {i + 1}/{len(episodes)} done", flush=True)
    return rows


def table(rows: list[dict], specs: list[str], ratios: list[float]) -> str:
    """Markdown: mean KL per policy and ratio; each later policy minus the first, and their per-request mean minus
    the first, with paired 95% intervals over requests."""
    value = {(r["episode"], r["policy"], r["ratio"]): r["kl"] for r in rows}
    episodes = sorted({r["episode"] for r in rows})
    lines = [f"| policy ({len(episodes)} requests) | " + " | ".join(f"{100 * (1 - r):g}% kept" for r in ratios) + " |",
             "|---|" + "---:|" * len(ratios)]
    for spec in specs:
        cells = [sum(value[e, spec, r] for e in episodes) / len(episodes) for r in ratios]
        lines.append(f"| {spec} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    first, others = specs[0], specs[1:]

    def diff_cell(a: list[float], b: list[float]) -> str:
        mean, low, high = paired_interval(a, b)
        verdict = "" if low > 0 or high < 0 else " (n.d.)"
        return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]{verdict}"

    for spec in others:
        lines.append(f"| {spec} - first | " + " | ".join(
            diff_cell([value[e, spec, r] for e in episodes], [value[e, first, r] for e in episodes]) for r in ratios)
            + " |")
    if len(others) > 1:
        lines.append("| mean of the others - first | " + " | ".join(
            diff_cell([sum(value[e, s, r] for s in others) / len(others) for e in episodes],
                      [value[e, first, r] for e in episodes]) for r in ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue,vt,qa_1")
    parser.add_argument("--samples", type=int, default=3, help="per task")
    parser.add_argument("--seed", type=int, default=3000)
    parser.add_argument("--policies", required=True, help="the warm start first, then the trained checkpoints")
    parser.add_argument("--ratios", default="0.5,0.75,0.875")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="CSV of the per-request values")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    model, tokenizer = load(args.model, dtype=args.dtype)
    spec = SampleSpec(model=args.model, tasks=args.tasks.split(","), lengths=[args.length], samples=args.samples,
                      seed=args.seed)
    episodes = episodes_from_samples(list(load_samples(spec, tokenizer)), tokenizer)
    specs, ratios = split_specs(args.policies), [float(r) for r in args.ratios.split(",")]
    rows = heldout_kl(model, episodes, specs, ratios)
    if args.out:
        with Path(args.out).open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=("episode", "policy", "ratio", "kl"))
            writer.writeheader()
            writer.writerows(rows)
    print(f"\n{args.model}, {args.length} tokens, {len(episodes)} requests (seeds from {args.seed}), {args.dtype}; "
          "mean KL(full || compressed) per continuation token, lower is better\n")
    print(table(rows, specs, ratios))


if __name__ == "__main__":
    main()
