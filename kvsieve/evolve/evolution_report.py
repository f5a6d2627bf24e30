"""The run report: progress per generation, plateaus, cascade rejections, time per candidate, and the
evidence of suspected reward hacking (which the CacheCraft paper reads as a sign that the editable
interface needs reformulating)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from kvsieve.evolve.database import ProgramDatabase
from kvsieve.evolve.evolve_config import EvolveConfig
from kvsieve.evolve.search import generation_summary

__all__ = ["SMOKE_REQUESTS", "diagnostics", "plot_progress", "smoke_note", "write_report"]

# fewer dev or held-out requests than this and one request moves a score by more than 5 points: a smoke test
SMOKE_REQUESTS = 20

STATUS_STAGE = {"rejected": "0 static", "invalid": "1 invariants", "error": "1 invariants (exception)",
                "killed": "1 invariants (killed)", "proxy_rejected": "2 proxy", "ok": "3 task (passed)"}


def smoke_note(config: EvolveConfig) -> str | None:
    """The line a run prints (and its report holds) when its dev or held-out set is under :data:`SMOKE_REQUESTS`
    requests, else None: a held-out 0.0 or a suspect read as the search failing, where one request decides them."""
    dev, held = len(config.tasks) * config.dev_samples, len(config.tasks) * config.heldout_samples
    if min(dev, held) >= SMOKE_REQUESTS:
        return None
    return (f"note: {dev} dev and {held} held-out request(s), fewer than {SMOKE_REQUESTS}: a smoke test of the loop. "
            f"One request moves a score by up to {100 / min(dev, held):.0f} points, so these scores (a held-out 0.0 "
            "included), their gap and the suspected reward hacking in report.md are noise, not a verdict on the "
            "programs; judge a search on a few dozen requests a set")


def diagnostics(db: ProgramDatabase, config: EvolveConfig, heldout: dict[int, float] | None = None) -> dict:
    records = db.records()
    evaluated = [r for r in records if r.evaluated]
    generations = generation_summary(db)
    plateaus, start, best = [], None, None
    for g in generations:
        if g["best"] is not None and (best is None or g["best"] > best):
            if start is not None and g["generation"] - start >= config.plateau_generations:
                plateaus.append((start, g["generation"] - 1))
            best, start = g["best"], g["generation"]
    last = generations[-1]["generation"] if generations else 0
    # the same rule as mid-run: the span from the last improvement to the last generation without one
    if start is not None and last - start + 1 >= config.plateau_generations:
        plateaus.append((start, last))
    seed = next((r for r in records if r.generation == 0 and r.island == 0 and r.slot == 0), None)
    suspects = []
    if seed is not None and seed.proxy is not None and seed.score is not None:
        for r in evaluated:
            # the cheap proxy says "better than the seed" while the task score does not improve (an
            # absolute margin could not fire for a seed scoring near 0, as in the shipped run)
            if r.proxy is not None and r.score is not None and r.proxy < seed.proxy and r.score <= seed.score \
                    and r.id != seed.id:
                suspects.append(dict(id=r.id, kind="proxy better, task no better",
                                     evidence=f"gap {r.proxy:.3f} < seed {seed.proxy:.3f}, score {r.score:.1f} <= "
                                              f"seed {seed.score:.1f}"))
    for r in evaluated:
        if r.degenerate:
            suspects.append(dict(id=r.id, kind="degenerate scores",
                                 evidence=f"constant scores within every KV head of every layer; score {r.score}"))
    for program_id, held in (heldout or {}).items():
        r = db.get(program_id)
        if r.score is not None and r.score - held > 15:
            suspects.append(dict(id=program_id, kind="dev/held-out gap",
                                 evidence=f"dev {r.score:.1f} vs held-out {held:.1f}"))
    seconds = [r.seconds for r in evaluated if r.seconds]
    return dict(
        evaluated=len(evaluated), attempts=len(records),
        statuses=dict(Counter(r.status for r in records)),
        rejections={STATUS_STAGE.get(k, k): v for k, v in Counter(r.status for r in evaluated).items()},
        seconds=dict(mean=round(statistics.fmean(seconds), 2), median=round(statistics.median(seconds), 2),
                     max=round(max(seconds), 2)) if seconds else {},
        sandbox_seconds=round(statistics.fmean([r.sandbox_seconds for r in evaluated]), 2) if evaluated else None,
        plateaus=plateaus, suspects=suspects, generations=generations,
    )


def _isolation_text(isolation: dict | None) -> str:
    if not isolation:
        return "not recorded"
    text = f"{isolation.get('level')}{' + seccomp' if isolation.get('seccomp') else ', no seccomp filter'}, " \
           f"worker uid {isolation.get('worker_uid')}"
    missing = isolation.get("missing") or []
    return text + (f"; missing: {'; '.join(missing)}" if missing else "")


def plot_progress(generations: list[dict], path: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [g["generation"] for g in generations]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(xs, [g["best"] for g in generations], label="best so far", color="C0")
    med = [(g["generation"], g["median"]) for g in generations if g["median"] is not None]
    ax.plot([m[0] for m in med], [m[1] for m in med], label="median of generation", color="C1", marker=".", lw=0.8)
    ax.set_xlabel("generation")
    ax.set_ylabel("dev score (0-100)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def write_report(db: ProgramDatabase, config: EvolveConfig, out: str | Path, heldout: dict[int, float],
                 reference: dict[str, float]) -> Path:
    """``out/report.md``, ``out/progress.png`` and ``out/diagnostics.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    diag = diagnostics(db, config, heldout)
    plot_progress(diag["generations"], out / "progress.png",
                  f"{config.model} {config.length} tokens, ratios {config.ratios}, {config.mutator} mutator")
    (out / "diagnostics.json").write_text(json.dumps(diag, indent=1))
    best = db.best()
    isolation = db.meta("isolation")
    lines = [f"# Evolution run: {config.strategy}, {config.mutator} mutator, seed {config.seed}", "",
             f"Sandbox isolation: {_isolation_text(isolation)} (docs/security.md).", "",
             f"Dev set: {config.model}, {config.length} tokens, tasks {', '.join(config.tasks)}, "
             f"{config.dev_samples} per task (seeds {config.dev_seed}+), ratios {config.ratios}; held-out seeds "
             f"{config.heldout_seed}+.", "",
             *([smoke, ""] if (smoke := smoke_note(config)) else []),
             f"Evaluated candidates: {diag['evaluated']} (attempts {diag['attempts']}); statuses: {diag['statuses']}.",
             f"Cascade outcome of evaluated candidates: {diag['rejections']}.",
             f"Seconds per candidate: {diag['seconds']}; sandbox part (spawn, invariants, scoring): "
             f"{diag['sandbox_seconds']}.", "",
             "| reference | dev score |", "|---|---:|"]
    lines += [f"| {name} | {value:.1f} |" for name, value in reference.items()]
    if best is not None:
        lines += ["", f"Best program: #{best.id} (generation {best.generation}, island {best.island}, "
                      f"{best.operation}), dev score {best.score:.1f}, proxy gap {best.proxy:.4f}, held-out "
                      f"{heldout.get(best.id, float('nan')):.1f}.", "", "```python", best.source.rstrip(), "```"]
    lines += ["", f"Plateaus (>= {config.plateau_generations} generations without a better program): "
                  f"{diag['plateaus'] or 'none'}.", "", "Suspected reward hacking:"]
    lines += [f"- #{s['id']} {s['kind']}: {s['evidence']}" for s in diag["suspects"][:20]] or ["- none"]
    lines += ["", "![progress](progress.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
