"""Grid speed: a (policy x ratio) grid on one sample, shared prefill + batched decode vs the naive loop.

Run: python benchmarks/grid_speed.py --model qwen2.5-0.5b --length 4096 [--agreement-samples 3]
Prints the cost of one full-cache run (prefill + answer), of the whole grid on the shared path,
and of the naive per-cell loop (one prefill per cell), plus how many predictions agree; with
--agreement-samples N, agreement is counted over the cells of N samples (timings use the first).
Each cell whose batched prediction differs is decoded again alone on the shared path: if that matches
the naive prediction, the shared prefill and compression were exact and the difference comes from
decoding in a batch (bf16 matrix products round differently for different batch sizes).
"""

from __future__ import annotations

import argparse
import time

import torch

import kvsieve
from kvsieve.engine.generate import generate
from kvsieve.harness.evaluate import evaluate_sample
from kvsieve.harness.grid import GridConfig
from kvsieve.models import load
from kvsieve.policies.label import Point
from kvsieve.tasks.load import load_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratios", default="0.25,0.5,0.75,0.875")
    parser.add_argument("--naive-cells", type=int, default=0, help="cells run on the naive path (0: all)")
    parser.add_argument("--agreement-samples", type=int, default=1, help="samples whose cells are compared")
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    grid = GridConfig(model=args.model, tasks=[args.task], lengths=[args.length], samples=args.agreement_samples,
                      seed=args.seed)
    sample, *more_samples = load_samples(grid.sample_spec(), tokenizer)  # the samples a grid with these settings runs
    policies = [n for n in kvsieve.policies.names(kinds=("policy",)) if n != "full"]
    cells = [Point(p, float(r)) for p in policies for r in args.ratios.split(",")]
    print(f"# {args.model}, {args.task} at {args.length} tokens, {len(policies)} policies x "
          f"{len(args.ratios.split(','))} ratios = {len(cells)} cells, {torch.get_num_threads()} threads")

    start = time.perf_counter()
    full = generate(model, tokenizer, sample.context, sample.question, answer_prefix=sample.answer_prefix,
                    max_new_tokens=sample.max_new_tokens, stop=tuple(sample.stop))
    one_run = time.perf_counter() - start
    print(f"one full-cache run: {one_run:.1f} s (answer {full.text!r})")

    start = time.perf_counter()
    shared = evaluate_sample(model, tokenizer, sample, cells, args.model, shared=True)
    shared_s = time.perf_counter() - start
    print(f"shared grid: {shared_s:.1f} s = {shared_s / one_run:.1f}x one run", flush=True)

    naive_cells = cells if args.naive_cells <= 0 else cells[:: max(1, len(cells) // args.naive_cells)]
    start = time.perf_counter()
    naive = evaluate_sample(model, tokenizer, sample, naive_cells, args.model, shared=False)
    naive_s = (time.perf_counter() - start) * len(cells) / len(naive_cells)
    note = "" if len(naive_cells) == len(cells) else f" (measured on {len(naive_cells)} cells, scaled)"
    print(f"naive grid: {naive_s:.1f} s = {naive_s / one_run:.1f}x one run{note}")
    for more in more_samples:
        shared += evaluate_sample(model, tokenizer, more, cells, args.model, shared=True)
        naive += evaluate_sample(model, tokenizer, more, naive_cells, args.model, shared=False)
        print(f"compared sample seed {more.seed}", flush=True)
    samples = {s.id: s for s in [sample, *more_samples]}
    by_key = {r.key: r.prediction for r in shared}
    differing = [r for r in naive if by_key[r.key] != r.prediction]
    same = len(naive) - len(differing)
    print(f"same prediction on the shared (batched) and naive paths: {same}/{len(naive)} cells "
          f"({100 * same / len(naive):.1f}%)")
    alone_same = 0
    for r in differing:
        cell = Point(r.key.policy, r.key.ratio, r.key.question_aware)
        [alone] = evaluate_sample(model, tokenizer, samples[r.key.sample_id], [cell], args.model, shared=True)
        alone_same += alone.prediction == r.prediction
        print(f"  differs: {r.key.sample_id} {cell.policy}@{cell.ratio}: batched {by_key[r.key]!r}, "
              f"naive {r.prediction!r}, shared decoded alone {alone.prediction!r}", flush=True)
    if differing:
        total = same + alone_same
        print(f"shared prefill + compression decoded alone matches the naive path on {alone_same}/{len(differing)} "
              f"differing cells: {total}/{len(naive)} cells ({100 * total / len(naive):.1f}%) without batching noise")


if __name__ == "__main__":
    main()
