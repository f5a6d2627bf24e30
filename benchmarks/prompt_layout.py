"""Prompt layout: does the compressed context end with the newline before the question, as RULER's do?

Run: python benchmarks/prompt_layout.py --model qwen2.5-coder-0.5b-instruct --length 4096 --samples 10

Last-query policies (TOVA, SnapKV's observation window) score the cache with the queries of the last
context tokens. kvsieve's prompt puts the newline that separates the context from the question at the
end of the context part, as RULER's templates do (haystack, newline, question); before, the context
part ended inside the haystack (its last sentence's "."), and the newline started the question. This
runs the same grid (full, tova, snapkv at one ratio) with both layouts on the same samples, into two
stores, and prints each policy's mean score per task and as a share of the full-cache score.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import kvsieve.harness.evaluate as runner
from kvsieve.harness.grid import GridConfig
from kvsieve.harness.run import run_grid
from kvsieve.harness.store import ResultsStore
from kvsieve.prompt import build_prompt

LAYOUTS = {"newline ends the context (RULER)": True, "context ends in the haystack (before)": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--policies", default="full,tova,snapkv")
    parser.add_argument("--out", default="results/prompt-layout", help="folder for the two stores")
    args = parser.parse_args()

    tasks = args.tasks.split(",")
    policies = args.policies.split(",")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    table: dict[str, dict[tuple[str, str], float]] = {}
    for label, in_context in LAYOUTS.items():
        store_path = Path(args.out) / f"{'ruler' if in_context else 'before'}.sqlite"
        # the runner builds every prompt through build_prompt: pin the layout for this run
        runner.build_prompt = functools.partial(build_prompt, separator_in_context=in_context)
        config = GridConfig(model=args.model, tasks=tasks, lengths=[args.length], policies=policies,
                            ratios=[args.ratio], samples=args.samples, store=str(store_path))
        run_grid(config).close()
        with ResultsStore(store_path) as store:
            rows = store.rows(model=args.model, task=tasks, length=[args.length])
        scores: dict[tuple[str, str], list[float]] = {}
        for r in rows:
            seed = int(r.key.sample_id.rsplit("-", 1)[1])
            if r.key.ratio in (0.0, args.ratio) and r.key.policy in policies and seed < args.samples:
                scores.setdefault((r.key.task, r.key.policy), []).append(r.score)
        table[label] = {k: sum(v) / len(v) for k, v in scores.items()}
    runner.build_prompt = build_prompt

    print(f"\n{args.model}, {args.length} tokens, ratio {args.ratio}, {args.samples} samples per task "
          f"(mean score x100; in brackets: share of the full-cache score)\n")
    print("| layout | task | " + " | ".join(policies) + " |")
    print("|---|---|" + "---:|" * len(policies))
    for label, means in table.items():
        for task in tasks:
            full = means.get((task, "full"), 0.0)
            cells = []
            for p in policies:
                m = means.get((task, p), float("nan"))
                cells.append(f"{m:.1f}" if p == "full" or not full else f"{m:.1f} ({100 * m / full:.0f}%)")
            print(f"| {label} | {task} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
