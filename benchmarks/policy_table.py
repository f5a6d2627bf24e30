"""Mean score per policy and ratio, and its share of the full cache's, on the requests every listed policy has.

results/qwen-4k.sqlite left results/ after commit 4b5c172 (`git show 4b5c172:results/qwen-4k.sqlite`).
Run: python benchmarks/policy_table.py --store results/qwen-4k.sqlite --model qwen2.5-coder-0.5b-instruct \
         [--policies full,frc,tova,...] [--ratios 0.75,0.875]

A request is (task, length, sample id); only requests on which every listed (policy, ratio) cell and
the full cache have rows count, so a grid that is still running (or a policy added later) is compared
on the same requests. Scores are averaged over tasks the way ``kvsieve report`` does (the mean of the
per-task means); the best query-agnostic policy other than the references is marked per ratio.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from kvsieve.harness.store import ResultsStore
from kvsieve.policies import split_specs

REFERENCES = ("full", "oracle", "kvzip")  # kvzip costs several prefills: a reference, not a single-pass policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--policies", help="comma-separated specs (default: every query-agnostic policy)")
    parser.add_argument("--ratios", help="comma-separated ratios (default: all)")
    parser.add_argument("--full", default="full", help="the reference row (full@decode128 for decode-mode rows)")
    args = parser.parse_args()

    scores: dict[tuple[str, float], dict[tuple, float]] = defaultdict(dict)
    with ResultsStore(args.store) as store:
        for r in store.rows(model=args.model):
            if not r.key.question_aware:
                scores[(r.key.policy, round(r.key.ratio, 6))][(r.key.task, r.key.length, r.key.sample_id)] = r.score
    if not scores:
        raise SystemExit(f"no rows for model {args.model!r} in {args.store}")
    policies = split_specs(args.policies) if args.policies else sorted({p for p, _ in scores})
    ratios = [float(x) for x in args.ratios.split(",")] if args.ratios else sorted({r for _, r in scores if r > 0})
    if args.full not in policies:
        policies.insert(0, args.full)
    references = (args.full, *REFERENCES)
    cells = [(p, 0.0 if p == args.full else r) for p in policies for r in ratios]
    missing = [c for c in cells if c not in scores]
    if missing:
        raise SystemExit(f"no rows for {missing[:5]}; policies in the store: {sorted({p for p, _ in scores})}")
    requests = set.intersection(*(set(scores[c]) for c in cells))
    tasks = sorted({t for t, _, _ in requests})

    def mean(cell) -> float:
        by_task = defaultdict(list)
        for request in requests:
            by_task[request[0]].append(scores[cell][request])
        return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)

    full = mean((args.full, 0.0))
    table = {(p, r): mean((p, 0.0 if p == args.full else r)) for p in policies for r in ratios}
    best = {r: max((table[(p, r)] for p in policies if p not in references), default=None) for r in ratios}
    print(f"{len(requests)} requests, {len(tasks)} tasks ({', '.join(tasks)}); full cache {full:.1f}\n")
    print("| policy | " + " | ".join(f"{r}" for r in ratios) + " |")
    print("|---|" + "---:|" * len(ratios))
    for p in sorted(policies, key=lambda p: (p != args.full, p in references, -sum(table[(p, r)] for r in ratios))):
        row = []
        for r in ratios:
            value = table[(p, r)]
            text = f"{value:.1f} ({100 * value / full:.0f}%)" if full else f"{value:.1f}"
            row.append(f"**{text}**" if p not in references and value == best[r] else text)
        print(f"| {p} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
