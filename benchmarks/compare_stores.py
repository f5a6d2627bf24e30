"""What moved between two grids: mean score per policy and ratio over the requests both stores hold.

The two stores left results/ after commit 4b5c172 (`git show 4b5c172:results/qwen-4k.sqlite > qwen-4k.sqlite`).
Run: python benchmarks/compare_stores.py --before results/before-fixes/qwen-4k.sqlite --before-model qwen2.5-0.5b \
         --after results/qwen-4k.sqlite --after-model qwen2.5-coder-0.5b-instruct

A request is (task, length, sample id); only requests with rows in both stores count (a policy only `after` has is
averaged over the requests `before` also holds), and a
(policy, ratio) cell is averaged over the requests both stores evaluated it on, so a grid that is
still running is compared on its finished samples. Prints one markdown table: before, after and the
change, averaged over tasks the way `kvsieve report` does (the mean of the per-task means).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from kvsieve.harness.store import ResultsStore

Cell = tuple[str, float, bool]  # policy, ratio, question-aware


def _scores(path: str, model: str) -> dict[Cell, dict[tuple, float]]:
    with ResultsStore(path) as store:
        out: dict[Cell, dict[tuple, float]] = defaultdict(dict)
        for r in store.rows(model=model):
            out[(r.key.policy, round(r.key.ratio, 6), r.key.question_aware)][(r.key.task, r.key.length,
                                                                              r.key.sample_id)] = r.score
    return out


def _task_mean(scores: dict[tuple, float], requests: set[tuple]) -> float:
    by_task: dict[str, list[float]] = defaultdict(list)
    for request in requests:
        by_task[request[0]].append(scores[request])
    return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True)
    parser.add_argument("--before-model", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--after-model", required=True)
    args = parser.parse_args()

    before, after = _scores(args.before, args.before_model), _scores(args.after, args.after_model)
    if not before or not after:
        raise SystemExit("no rows: check the store paths and model names")
    ratios = sorted({c[1] for c in after if c[1] > 0})
    policies = sorted({(c[0], c[2]) for c in after}, key=lambda p: (p[1], p[0] != "full", p[0]))
    counts = set()
    before_requests = set().union(*before.values())
    print("| policy | " + " | ".join(f"{r} before | after | change" for r in ratios) + " |")
    print("|---|" + "---:|---:|---:|" * len(ratios))
    for policy, qa in policies:
        cells = []
        for ratio in ratios:
            cell = (policy, 0.0 if policy == "full" else ratio, qa)
            shared = set(before.get(cell, {})) & set(after.get(cell, {}))
            if cell not in before:  # a policy new in `after`: its mean over the requests `before` also has
                mine = set(after.get(cell, {})) & before_requests
                cells.append(f"- | {_task_mean(after[cell], mine):.1f} | -" if mine else "- | - | -")
                continue
            if not shared:
                cells.append("- | - | -")
                continue
            counts.add(len(shared))
            b, a = _task_mean(before[cell], shared), _task_mean(after[cell], shared)
            cells.append(f"{b:.1f} | {a:.1f} | {a - b:+.1f}")
        print(f"| {policy}{'+qa' if qa else ''} | " + " | ".join(cells) + " |")
    print(f"\nrequests per cell: {min(counts)}-{max(counts)}" if counts else "\nno shared requests")


if __name__ == "__main__":
    main()
