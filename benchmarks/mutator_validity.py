"""How often each LLM mutator's proposals are programs: proposals a minute, % past stage 0 and stage 1, % novel.

    python benchmarks/mutator_validity.py --model qwen2.5-coder-0.5b-instruct --proposals 16 \
        --out results/mutators/qwen.jsonl

Each mutator (``local``: free decoding; ``constrained``: decoding under the language's typed grammar) proposes
children of the four seed programs in turn, the search's prompt with the seed's siblings as inspirations. Stage 0 is
``check_source``; stage 1 the sandbox's invariants on synthetic features (no dev set: nothing is scored). Novel:
a code hash not among the seeds and the mutator's earlier proposals. Every proposal is appended to ``--out`` as it
is made (rerunning the command skips those already there), so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kvsieve.evolve.mutators import ConstrainedLLMMutator, LocalLLMMutator
from kvsieve.evolve.sandbox import SandboxLimits, run_in_sandbox
from kvsieve.evolve.seeds import SEEDS
from kvsieve.language.program_source import Program
from kvsieve.language.static_check import StaticCheckError, check_source
from kvsieve.models import load

MUTATORS = {"local": LocalLLMMutator, "constrained": ConstrainedLLMMutator}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--proposals", type=int, default=20, help="per mutator")
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--out", default="results/mutators.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    done = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    model, tokenizer = load(args.model)
    seeds = [Program(s) for s in SEEDS.values()]
    for name, cls in MUTATORS.items():
        mutator = cls(model=model, tokenizer=tokenizer, max_new_tokens=args.max_new_tokens, temperature=0.8)
        seen = {p.code_hash for p in seeds}
        seen |= {r["code_hash"] for r in done if r["mutator"] == name and r["model"] == args.model}
        start_at = sum(1 for r in done if r["mutator"] == name and r["model"] == args.model)
        for i in range(start_at, args.proposals):
            parent = seeds[i % len(seeds)]
            rng = random.Random(i)
            start = time.perf_counter()
            child = mutator.propose(parent, [s for s in seeds if s is not parent], rng)
            seconds = time.perf_counter() - start
            row = {"model": args.model, "mutator": name, "i": i, "seconds": seconds, "proposal": child is not None,
                   "stage0": False, "stage1": False, "novel": False, "code_hash": "", "reason": "",
                   "reply": (mutator.last_reply or "")[:2000]}
            if child is not None:
                row["code_hash"] = child.code_hash
                row["novel"] = child.code_hash not in seen
                seen.add(child.code_hash)
                try:
                    check_source(child.source)
                    row["stage0"] = True
                except StaticCheckError as err:
                    row["reason"] = str(err)[:300]
                if row["stage0"]:
                    result = run_in_sandbox(child.source, window=16, limits=SandboxLimits(timeout_s=60))
                    row["stage1"] = result.status == "ok"
                    row["reason"] = "" if row["stage1"] else f"{result.status}: {result.reason[:300]}"
            with out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(f"{name} {i}: {seconds:.0f} s, proposal {row['proposal']}, stage 0 {row['stage0']}, "
                  f"stage 1 {row['stage1']}, novel {row['novel']} {row['reason'][:100]}", flush=True)
    report(out, args.model)


def report(path: Path, model: str) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    print("| mutator | model | proposals | per minute | past stage 0 | past stage 1 | novel |")
    print("|---|---|---|---|---|---|---|")
    for name in MUTATORS:
        mine = [r for r in rows if r["mutator"] == name and r["model"] == model]
        if not mine:
            continue
        n = len(mine)
        minutes = sum(r["seconds"] for r in mine) / 60
        pct = {k: 100 * sum(r[k] for r in mine) / n for k in ("stage0", "stage1", "novel")}
        print(f"| {name} | {model} | {n} | {n / minutes:.1f} | {pct['stage0']:.0f}% | {pct['stage1']:.0f}% | "
              f"{pct['novel']:.0f}% |")


if __name__ == "__main__":
    main()
