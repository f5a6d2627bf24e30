"""Seconds per evolution candidate (stages 1-3 of the cascade) on a small dev set.

    python benchmarks/evolve_candidate_time.py --model smollm2-135m-instruct --seed-program tova

Builds the dev set (prefills, not timed), evaluates the seed program once to warm up, then reports the
mean wall time of ``--repeats`` evaluations with the candidate's proxy and score. Quote the machine with
the figure (CPU model, flags, threads, dtype).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvsieve.evolve.cascade import FITNESSES, DevSet, evaluate_program
from kvsieve.evolve.seeds import SEEDS
from kvsieve.language.program_source import Program
from kvsieve.models import dtype_name, load
from kvsieve.tasks.load import SampleSpec, load_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tasks", default="niah_single_1,niah_multikey_1,vt")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=2, help="per task, seeds 1000+")
    parser.add_argument("--ratios", default="0.75,0.875")
    parser.add_argument("--seed-program", default="tova", choices=sorted(SEEDS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1000, help="first sample seed")
    parser.add_argument("--fitness", default="task", choices=FITNESSES,
                        help="task: stages 2-3 (decoding); likelihood: the graded stage 2 alone")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--dev-cache", default=None, help="keep the dev prefills here (read back on a rerun)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    model, tokenizer = load(args.model, dtype=args.dtype)
    spec = SampleSpec(model=args.model, tasks=args.tasks.split(","), lengths=[args.length], samples=args.samples,
                      seed=args.seed)
    dev = DevSet(model, tokenizer, list(load_samples(spec, tokenizer)), [float(r) for r in args.ratios.split(",")],
                 workdir=args.dev_cache)
    program = Program(SEEDS[args.seed_program])
    evaluate_program(program, dev, fitness=args.fitness)  # warm-up
    start = time.perf_counter()
    evaluations = [evaluate_program(program, dev, fitness=args.fitness) for _ in range(args.repeats)]
    seconds = (time.perf_counter() - start) / args.repeats
    first = evaluations[0]
    print(f"{args.model}, {len(dev.items)} dev samples x {len(dev.ratios)} ratios, seed {args.seed_program}, "
          f"{args.threads} thread(s), {dtype_name(model)}, fitness {args.fitness}: {seconds:.1f} s per candidate "
          f"(status {first.status}, proxy {first.proxy:.6f}, score {first.score})")


if __name__ == "__main__":
    main()
