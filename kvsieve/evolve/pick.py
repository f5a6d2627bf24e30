"""The selection rule: which evolved program is "the" program of a model, decided by a fixed rule from the
program databases, never by a score on the test requests.

The rule lives in a config file (``configs/selection.toml``)::

    order = ["dev_score", "proxy_gap", "heldout_score"]
    keep_seed_within_noise = false   # optional
    [models."qwen2.5-coder-0.5b-instruct"]
    databases = ["results/evolve/qwen-v2.sqlite", "results/evolve/qwen-v2-bestofn.sqlite"]

Among the programs of a model's databases that passed every stage (a dev score), the pick is the first in
``order``: ``dev_score`` higher first, ``proxy_gap`` (the answer log-likelihood gap to the full cache on the
dev prefills) lower first, ``heldout_score`` (scored only for the programs ranked best as a run ended;
missing counts as lowest) higher first; then the earlier database in the list, the earlier slot. Databases
are pooled only when their dev sets are the same (model, tasks, length, ratios, dev samples and seed,
window, decoding cap, helpers version and dtype): a dev score is comparable only on one dev set.

``kvsieve pick --config configs/selection.toml`` prints each model's pick with its dev, gap and held-out
scores beside the seed program's (the rule applied to the seed programs, generation 0, alone), and the pick's dev
margin over it with a paired 95% interval over the dev cells both scored: a lead whose interval holds 0 is
not shown to be more than the dev set's noise. With ``keep_seed_within_noise = true`` the rule acts on that: the
pick is the seed program unless the dev leader's lower bound is above 0 (a rule for runs declared after it; the
printout names the leader it passed over). ``--out DIR`` writes ``DIR/MODEL-picked.py``; ``--store S`` adds how many
policies were scored on the requests of a results store (the exploratory count).
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvsieve.bootstrap import two_level_interval
from kvsieve.bundled import canonical_name
from kvsieve.config import read_config_file
from kvsieve.evolve.database import ProgramDatabase, ProgramRecord
from kvsieve.evolve.seeds import SEEDS
from kvsieve.policies.kvzap import KVzap
from kvsieve.policies.label import Point
from kvsieve.policies.learned import LearnedPolicy
from kvsieve.policies.program import ProgramPolicy, program_spec

__all__ = ["CRITERIA", "DEV_SET_KEYS", "Pick", "SelectionRule", "exploratory", "format_pick", "load_rule", "pick",
           "pick_among", "summary", "write_pick"]

FOUND_OR_LEARNED = (ProgramPolicy.name, LearnedPolicy.name, KVzap.name)  # families counted as found or learned
# criterion -> (value of a program, +1 when higher is better, -1 when lower is)
CRITERIA = ("dev_score", "proxy_gap", "heldout_score")
DEV_SET_KEYS = ("model", "tasks", "length", "ratios", "dev_samples", "dev_seed", "window", "dev_max_new_tokens",
                "fitness", "dev_cells", "surrogate")


@dataclass(frozen=True)
class SelectionRule:
    order: tuple[str, ...]
    databases: dict[str, tuple[str, ...]]  # canonical model name -> program databases, in tie-break order
    path: str = ""
    keep_seed_within_noise: bool = False  # leave the seed program only for a dev lead whose interval excludes 0


@dataclass(frozen=True)
class Pick:
    model: str
    database: str
    program: ProgramRecord
    heldout: float | None
    seed: ProgramRecord | None  # the rule's pick among the seed programs (generation 0) alone, for comparison
    seed_heldout: float | None
    candidates: int  # programs with a dev score, pooled over the databases
    tied_on_dev: int  # of them, how many share the best dev score
    surrogate: str | None = None  # the kvzap checkpoint behind the dev set's f.surrogate (None: the shipped one)
    seed_database: str = ""
    # the pick's dev score minus the seed's: (mean, low, high) over the dev cells both scored, and how many; None
    # when the pick is that seed or they share no cell
    margin: tuple[float, float, float] | None = None
    margin_cells: int = 0
    # keep_seed_within_noise kept the seed: the dev leader it passed over (``margin`` is the leader's), else None
    passed_over: ProgramRecord | None = None
    passed_over_database: str = ""


def load_rule(path: str | Path) -> SelectionRule:
    """The rule in ``path``; ``ValueError`` naming the file for an unknown criterion or key, or no databases."""
    data = read_config_file(path)
    unknown = sorted(set(data) - {"order", "models", "keep_seed_within_noise"})
    if unknown:
        raise ValueError(f"selection rule {path}: unknown key(s) {unknown}; allowed: order, models, "
                         "keep_seed_within_noise")
    keep_seed = data.get("keep_seed_within_noise", False)
    if not isinstance(keep_seed, bool):
        raise ValueError(f"selection rule {path}: keep_seed_within_noise must be true or false, got {keep_seed!r}")
    order = tuple(data.get("order", CRITERIA))
    bad = [c for c in order if c not in CRITERIA] + (["dev_score first"] if order[:1] != ("dev_score",) else [])
    if bad or len(set(order)) != len(order):
        raise ValueError(f"selection rule {path}: order must start with dev_score and use each of {CRITERIA} at "
                         f"most once, got {list(order)}")
    models = data.get("models") or {}
    databases = {}
    for model, table in models.items():
        dbs = (table or {}).get("databases") or []
        if not dbs or not all(isinstance(d, str) for d in dbs):
            raise ValueError(f"selection rule {path}: models.{model!r} needs databases = [paths]")
        databases[canonical_name(model)] = tuple(dbs)
    if not databases:
        raise ValueError(f"selection rule {path}: no [models.NAME] table")
    return SelectionRule(order, databases, str(path), keep_seed)


def _dev_set(db: ProgramDatabase) -> dict[str, Any]:
    config = db.meta("config") or {}
    return {**{k: config.get(k) for k in DEV_SET_KEYS}, "helpers_version": db.meta("helpers_version"),
            "dtype": db.meta("dtype")}


def _heldout(db: ProgramDatabase) -> dict[int, float]:
    return {int(k): float(v) for k, v in (db.meta("heldout") or {}).items()}


def _key(order: tuple[str, ...], record: ProgramRecord, heldout: float | None, db_index: int) -> tuple:
    """Smaller is better: each criterion in ``order`` signed so, then the database's place, then the slot."""
    values = {"dev_score": -record.score,
              "proxy_gap": record.proxy if record.proxy is not None else math.inf,
              "heldout_score": -heldout if heldout is not None else math.inf}
    return (*(values[c] for c in order), db_index, record.generation, record.island, record.slot)


def pick_among(order: tuple[str, ...], records: list[ProgramRecord],
               heldout: dict[int, float] | None = None) -> ProgramRecord | None:
    """The program the rule's ``order`` picks among ``records`` of one database (those with a dev score count;
    ``heldout``: held-out scores by program id, missing counts as lowest); None when none is scored. What
    :func:`pick` does for one database, for any subset of it (a run's first N candidates)."""
    held = heldout or {}
    scored = [r for r in records if r.score is not None]
    return min(scored, key=lambda r: _key(order, r, held.get(r.id), 0)) if scored else None


def pick(rule: SelectionRule, model: str) -> Pick:
    """The rule's program for ``model``. ``ValueError`` when the databases' dev sets differ or none is scored."""
    model = canonical_name(model)
    if model not in rule.databases:
        raise ValueError(f"selection rule {rule.path}: no databases for model {model}; "
                         f"it has {', '.join(rule.databases)}")
    pooled: list[tuple[tuple, str, ProgramRecord, float | None]] = []
    reference: dict[str, Any] | None = None
    for index, path in enumerate(rule.databases[model]):
        if not Path(path).is_file():
            raise ValueError(f"selection rule {rule.path}: program database {path} does not exist")
        db = ProgramDatabase(path)
        try:
            dev = _dev_set(db)
            if reference is None:
                reference = dev
            elif dev != reference:
                differ = sorted(k for k in dev if dev[k] != reference[k])
                raise ValueError(f"selection rule {rule.path}: {path} was scored on another dev set than "
                                 f"{rule.databases[model][0]} ({', '.join(differ)} differ): its dev scores do not "
                                 "compare; list it under its own rule")
            held = _heldout(db)
            for record in db.scored():
                pooled.append((_key(rule.order, record, held.get(record.id), index), path, record,
                               held.get(record.id)))
        finally:
            db.close()
    if not pooled:
        raise ValueError(f"selection rule {rule.path}: no scored program for {model}")
    pooled.sort(key=lambda item: item[0])
    _, path, best, held = pooled[0]
    tied = sum(1 for _, _, r, _ in pooled if r.score == best.score)
    _, seed_path, seed, seed_held = next((item for item in pooled if item[2].generation == 0), (None, "", None, None))
    margin, cells = _margin(best, seed)
    leader = Pick(model, path, best, held, seed, seed_held, len(pooled), tied, reference["surrogate"], seed_path,
                  margin, cells)
    if rule.keep_seed_within_noise and margin is not None and margin[1] <= 0:
        return replace(leader, database=seed_path, program=seed, heldout=seed_held, passed_over=best,
                       passed_over_database=path)
    return leader


def _margin(program: ProgramRecord, seed: ProgramRecord | None) -> tuple[tuple[float, float, float] | None, int]:
    """``program``'s dev score minus ``seed``'s, paired over the dev cells both scored, with its 95% interval."""
    if seed is None or seed is program:
        return None, 0
    shared = sorted(set(program.cells) & set(seed.cells))
    if not shared:
        return None, 0
    return two_level_interval([[program.cells[k] - seed.cells[k] for k in shared]]), len(shared)


def exploratory(store_path: str | Path, model: str) -> dict[str, list[str]]:
    """The policies scored on a results store's requests of ``model``: published baselines, and found or
    learned ones (families ``program``, ``learned``, ``kvzap``), each listed once (labels as the store keys them);
    the full cache is neither."""
    labels = _policies(store_path, canonical_name(model))
    found = sorted(p for p, spec in labels.items() if spec.family in FOUND_OR_LEARNED)
    return {"found_or_learned": found,
            "baselines": sorted(p for p, spec in labels.items() if p not in found and not spec.is_full)}


def _policies(store_path: str | Path, model: str) -> dict[str, Point]:
    """Each stored label of ``model``'s rows, with a point of its stored spec (the store's ``spec`` column: what the
    family is; the label's text is not read)."""
    # read as a plain file, read-only: evolve/ sits below harness/ and does not import its store
    if not Path(store_path).is_file():
        raise ValueError(f"results store {store_path} does not exist")
    with sqlite3.connect(f"file:{store_path}?mode=ro", uri=True) as conn:
        try:
            rows = conn.execute("SELECT DISTINCT policy, spec FROM cells WHERE model = ?", (model,)).fetchall()
        except sqlite3.OperationalError as err:
            if "spec" not in str(err):
                raise
            raise ValueError(f"results store {store_path} was written before rows kept their point in structured "
                             f"form: migrate it once with `python -m kvsieve.harness.migrate {store_path}`") from None
    return {policy: Point(spec) for policy, spec in rows}


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _seed_file(r: ProgramRecord) -> bool:
    """A seed program read from a file (``seed_programs``): its id is this database's next one, whatever number the
    file's name may carry from the database it came from, so the printout names the file."""
    return (r.generation == 0 and r.mutator == "seed" and bool(r.operation) and r.operation not in SEEDS
            and r.operation != "copy")


def format_pick(p: Pick) -> str:
    """What ``kvsieve pick`` prints for one model."""
    r = p.program
    lines = [f"{p.model}: program #{r.id} of {p.database} (generation {r.generation}, island {r.island})",
             f"  dev score {_num(r.score)}, proxy gap {r.proxy if r.proxy is not None else float('nan'):.3f}, "
             f"held-out score {_num(p.heldout)}; {p.candidates} scored programs, {p.tied_on_dev} tied on the best "
             "dev score",
             ]
    if _seed_file(r):
        lines.insert(1, f"  a seed program, read from {r.operation}")
    if p.surrogate is not None:
        lines.append(f"  scored over the kvzap surrogate {p.surrogate} (evaluate with program(..., surrogate=...))")
    if p.passed_over is not None:
        lines.append(f"  the seed program, kept by keep_seed_within_noise over the dev leader #{p.passed_over.id} of "
                     f"{p.passed_over_database} (dev score {_num(p.passed_over.score)}): its lead {_margin_text(p)} "
                     "is not above 0")
        return "\n".join(lines)
    if p.seed is not None:
        lines.append(f"  the rule's pick among the seed programs: #{p.seed.id} of {p.seed_database}, dev score "
                     f"{_num(p.seed.score)}, held-out score {_num(p.seed_heldout)}")
    if p.margin is not None:
        _, low, high = p.margin
        verdict = ("not distinguishable: the lead over the seed may be the dev set's noise" if low <= 0 <= high
                   else "ahead" if low > 0 else "behind")
        lines.append(f"  pick - seed on dev: {_margin_text(p)}, {verdict}")
    return "\n".join(lines)


def _margin_text(p: Pick) -> str:
    mean, low, high = p.margin
    return f"{mean:+.2f} [{low:+.2f}, {high:+.2f}] (paired 95% interval over {p.margin_cells} dev cells)"


def write_pick(p: Pick, folder: str | Path, rule: str | Path) -> Path:
    """``folder/MODEL-picked.py``: the program's source, headed by the rule's file and where it found it."""
    out = Path(folder) / f"{p.model}-picked.py"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# picked by the selection rule ({rule}): #{p.program.id} of {p.database}, "
              f"dev {_num(p.program.score)}, gap {p.program.proxy or math.nan:.3f}, held-out {_num(p.heldout)}\n")
    if p.surrogate is not None:  # the program was scored over this surrogate: it is evaluated with it
        header += (f"# its f.surrogate is the kvzap checkpoint {p.surrogate}: "
                   f"{program_spec(out, p.surrogate)}\n")
    out.write_text(header + (p.program.source or "").rstrip() + "\n")
    return out


def summary(p: Pick) -> dict[str, Any]:
    """The pick as JSON-ready values."""
    return {"model": p.model, "database": p.database, "program": p.program.id, "dev_score": p.program.score,
            "proxy_gap": p.program.proxy, "heldout_score": p.heldout, "candidates": p.candidates,
            "tied_on_dev": p.tied_on_dev, "seed_program": p.seed.id if p.seed else None,
            "seed_dev_score": p.seed.score if p.seed else None, "seed_heldout_score": p.seed_heldout,
            "surrogate": p.surrogate, "seed_database": p.seed_database,
            "margin_over_seed": list(p.margin) if p.margin else None, "margin_cells": p.margin_cells,
            "passed_over": p.passed_over.id if p.passed_over else None,
            "passed_over_database": p.passed_over_database or None}
