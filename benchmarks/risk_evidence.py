"""Risk-control evidence from a results store: split validity and certified operating points.

    python benchmarks/risk_evidence.py --store results/smollm2-2k.sqlite --model smollm2-135m --splits 500

Candidates are every query-agnostic compressing (policy, ratio) in the store. Prints Markdown tables:

1. validity: over random calibration/test splits, how often the chosen point's risk exceeds alpha
   (on the test split, and pooled over all requests), for certification and for empirical thresholding;
2. operating points: on all requests, the certified point per model, per task family and per task
   (delta split over the buckets) next to empirical thresholding's choice.
"""

from __future__ import annotations

import argparse
import time

from kvsieve.harness.store import ResultsStore
from kvsieve.policies import REFERENCE
from kvsieve.policies.label import Point
from kvsieve.risk import (
    Contract,
    InsufficientCalibrationError,
    certify_buckets,
    empirical_threshold,
    loss_table,
)
from kvsieve.risk.validity import split_validity


def _candidates(store: ResultsStore, model: str) -> list[Point]:
    keys = {(k.policy, k.ratio) for k in store.keys(model=model, question_aware=False)}
    return sorted(Point(p, r) for p, r in keys if p != "full" and p not in REFERENCE and r > 0)


def _point(c: Point | None, table) -> str:
    if c is None:
        return "full KV"
    return f"{c.policy} @ {c.ratio:g} (keeps {100 * table.kept_fraction[c]:.1f}% of the bytes)"


def _kept(c: Point | None, table) -> float:
    return 100.0 if c is None else 100 * table.kept_fraction[c]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--alphas", default="0.05,0.1,0.2", help="target risks for the operating points")
    parser.add_argument("--validity-alphas", default="0.05,0.1,0.2,0.3,0.4", help="target risks for validity")
    parser.add_argument("--delta", type=float, default=0.1)
    parser.add_argument("--epsilon", type=float, default=0.0)
    parser.add_argument("--correction", default="bonferroni")
    parser.add_argument("--splits", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    validity_alphas = [float(a) for a in args.validity_alphas.split(",")]

    with ResultsStore(args.store) as store:
        candidates = _candidates(store, args.model)
        table = loss_table(store, args.model, candidates, args.epsilon, "binary")
    tasks = sorted({t for t, _, _ in table.requests})
    print(f"# {args.model}: {table.n} requests ({', '.join(tasks)}), {len(candidates)} candidates, "
          f"delta={args.delta}, epsilon={args.epsilon}, correction={args.correction}\n")

    print(f"## Validity over {args.splits} random 50/50 calibration/test splits\n")
    print("| alpha | method | violation rate, test split [95% CI] | violation rate, pooled risk | "
          "mean retention | full-KV fallbacks |")
    print("|---|---|---|---|---|---|")
    start = time.perf_counter()
    for alpha in validity_alphas:
        contract = Contract(alpha=alpha, delta=args.delta, epsilon=args.epsilon, correction=args.correction)
        try:
            result = split_validity(table, contract, splits=args.splits, seed=args.seed)
        except InsufficientCalibrationError as err:
            print(f"| {alpha} | certified | {err} | | | |")
            continue
        for name, summary in (("certified", result.certified), ("empirical threshold", result.empirical)):
            lo, hi = summary.interval()
            print(f"| {alpha} | {name} | {summary.violation_rate:.3f} [{lo:.3f}, {hi:.3f}] | "
                  f"{summary.pooled_violations / summary.splits:.3f} | {summary.mean_retention:.3f} | "
                  f"{summary.fallbacks / summary.splits:.0%} |")
    n_cal = int(round(0.5 * table.n))  # what split_validity uses
    print(f"\n(n calibration = {n_cal}, n test = {table.n - n_cal}; "
          f"{time.perf_counter() - start:.1f} s)\n")

    print("## Operating points certified on all requests\n")
    print("| alpha | bucket | n | certified (delta split over the buckets) | empirical threshold | "
          "extra cache the guarantee costs (points) |")
    print("|---|---|---|---|---|---:|")
    for alpha in alphas:
        contract = Contract(alpha=alpha, delta=args.delta, epsilon=args.epsilon, correction=args.correction)
        for by in ("none", "task_family", "task"):
            result = certify_buckets(table, contract, args.model, by=by)
            rows = table.buckets(by)
            for name, cert in result.buckets.items():
                baseline = empirical_threshold(table.subset(rows[name]), alpha)
                chosen = _point(cert.chosen, table) if cert.chosen or not cert.reason.startswith("too few") else \
                    "full KV (too few requests)"
                gap = _kept(cert.chosen, table) - _kept(baseline, table)
                print(f"| {alpha} | {'all' if by == 'none' else name} | {cert.n} | {chosen} | "
                      f"{_point(baseline, table)} | {gap:.1f} |")


if __name__ == "__main__":
    main()
