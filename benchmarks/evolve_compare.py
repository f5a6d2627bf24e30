"""What evolution adds over its controls at equal budgets.

The replicated study (issue 50; benchmarks/study/): evolution, best-of-N and random programs, several seeds
each, the same number of evaluated candidates per run, each run's program picked by the fixed rule, scored on
held-out requests:

    python benchmarks/evolve_compare.py run --config configs/evolve-compare-smollm2.toml --seeds 0,1,2 \
        --candidates 48 --step 8          (rerun the same command to resume; every run grows in rounds of --step)
    python benchmarks/evolve_compare.py report --config configs/evolve-compare-smollm2.toml --seeds 0,1,2 \
        --every 8 [--correlation 32] [--plot OUT/curve-X.png]   (held-out scores cached in OUT/heldout.json;
                                           prints markdown, draws the curve to --plot, default OUT/curve.png;
                                           --correlation N: Spearman of dev fitness vs accuracy)

Two databases of one evolution and its best-of-N control (the older, unreplicated comparison, on dev scores):

    python benchmarks/evolve_compare.py --run results/evolve/qwen-surrogate.sqlite \
         --control results/evolve/qwen-surrogate-bestofn.sqlite

Both databases must come from the same dev set and seeds (``DEV_KEYS`` equal; the search settings may differ).
A budget of N candidates is the first N evaluated programs in (generation, island, slot) order, the seeds
included (copies, duplicates and unusable proposals cost nothing); the best program at a budget is the one the
run itself would export (task score, then the smaller stage-2 gap). Prints markdown: the best of each run at
every ``--every`` candidates, then, at the largest budget both reached, paired differences over the dev samples
(each sample's task score averaged over the ratios; 95% percentile-bootstrap interval).

The best programs were chosen on these same dev samples, so "best minus seed" is biased upwards (the winner's
curse grows with the number of candidates); only a held-out evaluation (``kvsieve eval`` on seeds the dev set
never used) says how much of a gain carries over.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from study.report import study_report
from study.runs import ARMS, run_study, study_runs

from kvsieve.bootstrap import bootstrap_interval
from kvsieve.evolve.database import ProgramRecord, rank_key
from kvsieve.evolve.pick import load_rule

# what the dev cells and the starting point depend on: equal in a run and its control, or their cells do not pair
DEV_KEYS = ("model", "tasks", "length", "ratios", "dev_samples", "dev_seed", "window", "dev_max_new_tokens", "dtype",
            "seed_programs")
COLUMNS = [f.name for f in ProgramRecord.__dataclass_fields__.values()]


def read_run(path: str) -> tuple[dict, list[ProgramRecord]]:
    """The run's configuration and its evaluated programs in (generation, island, slot) order, read only."""
    if not Path(path).is_file():
        raise SystemExit(f"no program database at {path!r}")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)  # a running evolution may be writing it
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
        present = {r[1] for r in conn.execute("PRAGMA table_info(programs)")}
        columns = [c for c in COLUMNS if c in present]  # older databases lack the newer columns (defaults)
        rows = conn.execute(f"SELECT {', '.join(columns)} FROM programs "
                            "WHERE status NOT IN ('duplicate', 'no_proposal', 'migrated') "
                            "ORDER BY generation, island, slot").fetchall()
    finally:
        conn.close()
    if row is None:
        raise SystemExit(f"{path} holds no run configuration")
    records = []
    for r in rows:
        values = dict(zip(columns, r))
        values["inspiration_ids"] = json.loads(values["inspiration_ids"])
        values["cells"] = json.loads(values["cells"])
        values["degenerate"] = bool(values["degenerate"])
        records.append(ProgramRecord(**values))
    return json.loads(row[0]), records


def check_same_dev_set(run: dict, control: dict) -> None:
    """Refuse two runs whose dev sets or seeds differ: their dev cells would not pair."""
    differ = [k for k in DEV_KEYS if run.get(k) != control.get(k)]
    if differ:
        raise SystemExit("the runs do not share a dev set and seeds: " +
                         "; ".join(f"{k}: {run.get(k)!r} vs {control.get(k)!r}" for k in differ))


def best_at(records: list[ProgramRecord], budget: int) -> ProgramRecord | None:
    """The best scored program among the first ``budget`` evaluated ones."""
    scored = [r for r in records[:budget] if r.score is not None]
    return max(scored, key=rank_key) if scored else None


def per_sample(record: ProgramRecord) -> dict[str, float]:
    """Each dev sample's task score averaged over the ratios (cells are keyed "sample/ratio")."""
    by_sample: dict[str, list[float]] = defaultdict(list)
    for key, value in record.cells.items():
        by_sample[key.split("/")[0]].append(value)
    return {k: sum(v) / len(v) for k, v in by_sample.items()}


def paired(a: ProgramRecord, b: ProgramRecord) -> tuple[float, tuple[float, float], int]:
    """Mean of a - b over the dev samples both were decoded on, its bootstrap interval, and n."""
    sa, sb = per_sample(a), per_sample(b)
    common = sorted(set(sa) & set(sb), key=int)
    if not common:
        raise SystemExit(f"programs #{a.id} and #{b.id} share no dev sample")
    diff = np.array([sa[k] - sb[k] for k in common])
    return float(diff.mean()), bootstrap_interval(diff), len(common)


def _describe(record: ProgramRecord | None) -> str:
    if record is None:
        return "none scored"
    return f"{record.score:.1f} / {record.proxy:.3f} (#{record.id}, gen {record.generation})"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("run", "report"):
        study_main(sys.argv[1], sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="the evolution's program database")
    parser.add_argument("--control", required=True, help="the best-of-N control's program database")
    parser.add_argument("--every", type=int, default=8, help="print the best programs every N candidates")
    args = parser.parse_args()
    if args.every < 1:
        parser.error(f"--every must be >= 1, got {args.every}")
    run_config, run = read_run(args.run)
    control_config, control = read_run(args.control)
    check_same_dev_set(run_config, control_config)
    if run_config.get("strategy", "evolve") == control_config.get("strategy", "evolve"):
        raise SystemExit(f"both runs use strategy {run_config.get('strategy', 'evolve')!r}: give the evolution "
                         "and its best-of-N control")
    seeds = [r for r in run if r.generation == 0]
    if [r.code_hash for r in seeds] != [r.code_hash for r in control if r.generation == 0]:
        raise SystemExit("the runs' seed programs differ (a seed file changed between them): their starting points "
                         "are not the same")
    budget = min(len(run), len(control))
    print(f"run: {args.run} ({len(run)} evaluated); control: {args.control} ({len(control)} evaluated); "
          f"{len(seeds)} seeds, the same programs in both\n")
    print("| candidates | evolution: best dev score / gap (program) | best-of-N: best dev score / gap (program) |")
    print("|---:|---|---|")
    marks = sorted({*range(args.every, budget + 1, args.every), budget} - {0})
    for n in marks:
        print(f"| {n} | {_describe(best_at(run, n))} | {_describe(best_at(control, n))} |")
    best_run, best_control, best_seed = best_at(run, budget), best_at(control, budget), best_at(seeds, len(seeds))
    if best_run is None or best_control is None or best_seed is None:
        print("\nno paired comparison: a run has no scored program yet")
        return
    print(f"\nAt {budget} candidates each, paired over dev samples (score averaged over ratios; 95% bootstrap):\n")
    print("| comparison | mean difference | 95% interval | n |")
    print("|---|---:|---|---:|")
    for label, a, b in (("evolution best - best-of-N best", best_run, best_control),
                        (f"evolution best - best seed (#{best_seed.id})", best_run, best_seed),
                        (f"best-of-N best - best seed (#{best_seed.id})", best_control, best_seed)):
        mean, (low, high), n = paired(a, b)
        verdict = "" if low > 0 or high < 0 else " (not distinguishable)"
        print(f"| {label} | {mean:+.1f}{verdict} | [{low:+.1f}, {high:+.1f}] | {n} |")


def study_main(verb: str, argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog=f"evolve_compare.py {verb}")
    parser.add_argument("--config", required=True, help="the study's shared EvolveConfig (configs/evolve-compare-*)")
    parser.add_argument("--seeds", default="0,1,2", help="run seeds, comma-separated")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rule", default="configs/selection.toml", help="the fixed rule whose order picks")
    if verb == "run":
        parser.add_argument("--candidates", type=int, default=None, help="per run (default: the config's)")
        parser.add_argument("--step", type=int, default=8, help="candidates added to every run per round")
    else:
        parser.add_argument("--every", type=int, default=8, help="curve points every N candidates")
        parser.add_argument("--curve", default="likelihood", choices=("likelihood", "task"),
                            help="the held-out measure of the best-so-far curve (task: decoded accuracy, costlier)")
        parser.add_argument("--plot", default=None, help="where to draw the curve (default: OUT/curve.png)")
        parser.add_argument("--budget", type=int, default=None,
                            help="compare the picks among each run's first N candidates (default: the shortest run's)")
        parser.add_argument("--correlation", type=int, default=0,
                            help="also score N distinct programs (spread over the dev fitness) on held-out requests "
                                 "and give the Spearman correlation of dev fitness with held-out accuracy")
    args = parser.parse_args(argv)
    import torch

    from kvsieve.evolve.evolve_config import load_config
    from kvsieve.models import dtype_name, load

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    base = load_config(args.config)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    runs = study_runs(base, arms, seeds)
    if verb == "run":
        model, tokenizer = load(base.model, dtype=base.dtype)
        run_study(runs, args.candidates or base.candidates, args.step, model, tokenizer, dtype_name(model))
        return

    print(study_report(base, runs, load_rule(args.rule).order, args.every, args.correlation, load, args.curve,
                       args.plot, args.budget))


if __name__ == "__main__":
    main()
