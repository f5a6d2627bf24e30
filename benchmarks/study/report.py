"""The matched-budget study's report: each run's pick on held-out requests, the arms compared pooled over seeds, the
best-so-far curve, and (optionally) how well the dev fitness ranks programs as held-out accuracy does."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvsieve.bootstrap import spearman_interval, two_level_interval
from kvsieve.evolve.cascade import DevSet
from kvsieve.evolve.database import ProgramRecord
from kvsieve.evolve.evolve_config import EvolveConfig, dev_samples
from kvsieve.evolve.sandbox import SandboxLimits
from study.runs import (
    SKIPPED,
    HeldoutScores,
    StudyRun,
    evaluated_records,
    per_request,
    picks_at,
)

__all__ = ["study_report", "spread_programs", "proposals"]

PAIRS = (("evolve_random", "random"), ("evolve_random", "evolve"), ("evolve_llm", "best_of_n_llm"),
         ("evolve_llm", "random"), ("best_of_n_llm", "random"), ("evolve_mixed", "best_of_n_mixed"),
         ("evolve_mixed", "random"), ("evolve_mixed", "evolve"), ("best_of_n_mixed", "random"), ("evolve", "best_of_n"),
         ("evolve", "random"), ("best_of_n", "random"))
# evolution - its control, seed by seed
PER_SEED = (("evolve_random", "random"), ("evolve_llm", "best_of_n_llm"), ("evolve_mixed", "best_of_n_mixed"),
            ("evolve", "best_of_n"))


def spread_programs(records: list[ProgramRecord], count: int) -> list[ProgramRecord]:
    """``count`` distinct scored programs spread evenly over the dev fitness (sorted by it, evenly spaced)."""
    distinct: dict[str, ProgramRecord] = {}
    for record in records:
        if record.score is not None:
            distinct.setdefault(record.code_hash, record)
    ordered = sorted(distinct.values(), key=lambda r: (r.score, r.code_hash))
    if len(ordered) <= count:
        return ordered
    return [ordered[round(i * (len(ordered) - 1) / (count - 1))] for i in range(count)]


def _fmt(mean: float, low: float, high: float, signed: bool = False) -> str:
    f = "{:+.1f}" if signed else "{:.1f}"
    return f"{f.format(mean)} [{f.format(low)}, {f.format(high)}]"


def study_report(base: EvolveConfig, runs: list[StudyRun], order: tuple[str, ...], every: int, correlation: int,
                 loader: Callable, curve_measure: str = "likelihood", plot: str | Path | None = None,
                 budget: int | None = None) -> str:
    """Markdown: the runs, their picks' held-out scores, the pooled comparisons at ``budget`` candidates (default: as
    many as the shortest run holds), the curve of ``curve_measure`` (also drawn to ``plot``, default
    ``OUT/curve.png``), each mutator's proposals and, with ``correlation`` > 0, the fitness's rank agreement with
    held-out accuracy. Held-out cells as the dev set's (``dev_cells``)."""
    found = {}
    for run in runs:
        if Path(run.config.db).is_file():
            found[(run.arm, run.seed)] = evaluated_records(run.config.db)[1]
    if not found:
        raise ValueError(f"no study database under {base.out}")
    shortest = min(len(r) for r in found.values())
    if budget is None:
        budget = shortest
    elif not 1 <= budget <= shortest:
        raise ValueError(f"budget must be in 1..{shortest} (the shortest run's distinct evaluated programs), "
                         f"got {budget}")
    found = {key: records[:budget] for key, records in found.items()}
    marks = sorted({*range(every, budget + 1, every), budget})
    picks = {key: picks_at(records, order, marks) for key, records in found.items()}
    cache = HeldoutScores(Path(base.out) / "heldout.json", alternate=base.dev_cells == "alternate")
    limits = SandboxLimits(timeout_s=base.sandbox_timeout_s, memory_mb=base.sandbox_memory_mb)
    loaded: dict = {}

    def held() -> DevSet:
        model, tokenizer = loader(base.model, dtype=base.dtype)
        loaded["model"] = model
        return DevSet(model, tokenizer, dev_samples(base, tokenizer, base.heldout_seed, base.heldout_samples),
                      base.ratios, base.window, Path(base.out) / "heldout-cache", progress=True,
                      surrogate=base.surrogate)

    def score(record: ProgramRecord, measures: tuple[str, ...] = ("task", "likelihood")) -> dict:
        if not cache.has(record.code_hash, measures):
            print(f"held-out {measures}: program #{record.id} (dev {record.score:.2f})", file=sys.stderr, flush=True)
        return cache.score(record, held, limits, measures)

    seed_record = next(iter(found.values()))[0]
    score(seed_record)
    for key in found:  # the final picks first, then the curve from the end
        score(picks[key][budget])
    for n in marks[::-1]:
        for key in found:
            score(picks[key][n], (curve_measure,))
    arms = list(dict.fromkeys(arm for arm, _ in found))
    seeds = sorted({seed for _, seed in found})
    lines = [f"Study: {len(found)} runs ({', '.join(arms)} x seeds {', '.join(map(str, seeds))}), {budget} distinct "
             f"evaluated candidates each (seed program included); dev fitness: {base.fitness} over "
             f"{base.dev_samples} x "
             f"{len(base.tasks)} requests ({base.dev_cells} cells); held-out: {base.heldout_samples} x "
             f"{len(base.tasks)} requests (seeds from {base.heldout_seed}) at ratios {base.ratios} ({base.dev_cells} "
             f"cells), accuracy decoded; the pick: order {list(order)}.", ""]
    seed_held = cache.get(seed_record.code_hash)
    lines += [f"Seed program #{seed_record.id} ({seed_record.operation}): dev {seed_record.score:.2f}, held-out "
              f"accuracy {seed_held['task']:.1f}, held-out likelihood {seed_held['likelihood']:.2f}", "",
              "| arm | seed | pick (generation) | dev fitness | held-out accuracy | held-out likelihood |",
              "|---|---:|---|---:|---:|---:|"]
    for arm in arms:
        for seed in seeds:
            if (arm, seed) not in found:
                continue
            p = picks[(arm, seed)][budget]
            h = cache.get(p.code_hash)
            lines.append(f"| {arm} | {seed} | #{p.id} ({p.generation}) | {p.score:.2f} | {h['task']:.1f} | "
                         f"{h['likelihood']:.2f} |")

    def matrix(arm: str, n: int, measure: str) -> np.ndarray:
        rows = []
        for seed in seeds:
            cells = cache.get(picks[(arm, seed)][n].code_hash)[f"{measure}_cells"]
            rows.append(list(per_request(cells).values()))
        return np.array(rows)

    seed_cells = {m: np.array(list(per_request(seed_held[f"{m}_cells"]).values())) for m in ("task", "likelihood")}
    lines += ["", f"Pooled over seeds at {budget} candidates (held-out, per request averaged over the ratios; 95% "
              "bootstrap resampling seeds and requests):", "",
              "| comparison | accuracy difference | likelihood difference |", "|---|---|---|"]
    for a, b in PAIRS + tuple((arm, "seed") for arm in arms):
        if a not in arms or (b not in arms and b != "seed"):
            continue
        out = []
        for measure in ("task", "likelihood"):
            other = matrix(b, budget, measure) if b != "seed" else seed_cells[measure][None, :]
            out.append(_fmt(*two_level_interval(matrix(a, budget, measure) - other), signed=True))
        lines.append(f"| {a} - {'seed program' if b == 'seed' else b} | {out[0]} | {out[1]} |")
    for a, b in PER_SEED:
        if a not in arms or b not in arms:
            continue
        per_seed = []
        for seed in seeds:
            if (a, seed) in found and (b, seed) in found:
                d = matrix(a, budget, "task")[seeds.index(seed)] - matrix(b, budget, "task")[seeds.index(seed)]
                per_seed.append(f"seed {seed}: {d.mean():+.1f}")
        lines += ["", f"{a} - {b} accuracy per seed: " + "; ".join(per_seed)]
    name = {"task": "accuracy", "likelihood": "likelihood"}[curve_measure]
    lines += ["", f"Best-so-far curve: held-out {name} of the rule's pick among the first N candidates (mean over "
              "seeds [95% bootstrap over seeds and requests]); dev fitness of the pick (mean over seeds)", "",
              "| N | " + " | ".join(f"{a}: held-out | {a}: dev" for a in arms) + " |",
              "|---:|" + "---|---:|" * len(arms)]
    curve = {a: [] for a in arms}
    for n in marks:
        cols = []
        for arm in arms:
            m = two_level_interval(matrix(arm, n, curve_measure))
            curve[arm].append(m)
            dev = np.mean([picks[(arm, s)][n].score for s in seeds])
            cols += [_fmt(*m), f"{dev:.2f}"]
        lines.append(f"| {n} | " + " | ".join(cols) + " |")
    present = [(a, b) for a, b in PAIRS if a in arms and b in arms]
    if present:  # the same curve as paired differences: the arms' levels share the requests' and seeds' variation
        lines += ["", f"Paired difference of the held-out {name} along the curve (95% bootstrap over seeds and "
                  "requests)", "", "| N | " + " | ".join(f"{a} - {b}" for a, b in present) + " |",
                  "|---:|" + "---|" * len(present)]
        for n in marks:
            cells = [_fmt(*two_level_interval(matrix(a, n, curve_measure) - matrix(b, n, curve_measure)), signed=True)
                     for a, b in present]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    plot = Path(plot) if plot is not None else Path(base.out) / "curve.png"
    _plot(curve, marks, plot, f"held-out {name} of the rule's pick")
    lines += ["", f"Curve: {plot}"]
    lines += ["", "Proposals of each arm's mutators over all its runs (every proposal the run made, duplicates and "
              "replies with no program included; 95% Wilson intervals): past stage 0 = accepted by the static check, "
              "past stage 1 = also by the sandbox's invariants, novel = code no earlier program of its run had", "",
              "| arm | mutator | proposals | past stage 0 | past stage 1 | novel |", "|---|---|---:|---|---|---|"]
    for arm in arms:
        rows = [r for run in runs if run.arm == arm and (arm, run.seed) in found
                for r in proposals(run.config.db, budget)]
        for mutator in dict.fromkeys(r.mutator for r in rows):
            mine = [r for r in rows if r.mutator == mutator]
            counts = (sum(r.stage >= 0 for r in mine), sum(r.stage >= 1 for r in mine),
                      sum(r.status not in ("duplicate", "no_proposal") for r in mine))
            lines.append(f"| {arm} | {mutator} | {len(mine)} | " + " | ".join(_share(k, len(mine)) for k in counts)
                         + " |")
    if correlation > 0:
        pooled = [r for records in found.values() for r in records]
        chosen = spread_programs(pooled, correlation)
        for record in chosen:
            score(record)
        dev = [r.score for r in chosen]
        acc = [cache.get(r.code_hash)["task"] for r in chosen]
        lik = [cache.get(r.code_hash)["likelihood"] for r in chosen]
        lines += ["", f"Fitness vs accuracy over {len(chosen)} distinct programs of the study (spread over the dev "
                  "fitness): Spearman's rho [95% bootstrap over programs]", "",
                  f"- held-out likelihood vs held-out accuracy (same requests): {_rho(lik, acc)}",
                  f"- dev fitness vs held-out accuracy: {_rho(dev, acc)}",
                  f"- held-out accuracy range {min(acc):.1f}-{max(acc):.1f}, distinct values {len(set(acc))}"]
    return "\n".join(lines)


def proposals(path: str | Path, budget: int) -> list[ProgramRecord]:
    """The rows a run's mutators proposed (not the seeds, not migrations' copies) up to its ``budget``-th distinct
    evaluated program, in (generation, island, slot) order."""
    out, evaluated = [], set()
    for record in evaluated_records(path, every_row=True)[1]:
        if len(evaluated) >= budget:
            break
        if record.status not in SKIPPED:
            evaluated.add(record.code_hash)
        if record.generation > 0 and record.status != "migrated":
            out.append(record)
    return out


def _share(k: int, n: int) -> str:
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(method="wilson")
    return f"{100 * k / n:.0f}% [{100 * ci.low:.0f}, {100 * ci.high:.0f}]"


def _rho(x, y) -> str:
    rho, low, high = spearman_interval(x, y)
    return f"{rho:.2f} [{low:.2f}, {high:.2f}]"


def _plot(curve: dict, marks: list[int], path: Path, ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, points in curve.items():
        mean = [p[0] for p in points]
        ax.plot(marks, mean, marker="o", label=arm)
        ax.fill_between(marks, [p[1] for p in points], [p[2] for p in points], alpha=0.15)
    ax.set_xlabel("candidates evaluated")
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
