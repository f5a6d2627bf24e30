"""The selection rule: the config's order applied to program databases (dev score, then proxy gap, then held-out
score), pooling only databases of one dev set; the command prints the pick and the exploratory count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvsieve.cli import main
from kvsieve.evolve.database import ProgramDatabase
from kvsieve.evolve.pick import exploratory, format_pick, load_rule, pick, summary, write_pick
from kvsieve.harness.store import CellKey, CellResult, ResultsStore

REPO = Path(__file__).resolve().parents[2]
DEV = {"model": "smollm2-135m-instruct", "tasks": ["niah_single_1"], "length": 512, "ratios": [0.75], "dev_samples": 1,
       "dev_seed": 1000, "window": 64, "dev_max_new_tokens": None}


def database(path: Path, programs: list[tuple[float | None, float | None]], heldout: dict[int, float] | None = None,
             **dev) -> Path:
    """A program database: (dev score, proxy gap) per program, ids from 1 in order, the first the seed."""
    db = ProgramDatabase(path)
    db.set_meta("config", {**DEV, **dev})
    db.set_meta("dtype", "float32")
    for i, (score, proxy) in enumerate(programs):
        db.add(dict(generation=i, island=0, slot=0, mutator="seed" if i == 0 else "m", status="ok", stage=3,
                    score=score, proxy=proxy, source=f"def score(f):\n    return f.attn  # {i + 1}", code_hash=str(i)))
    if heldout:
        db.set_meta("heldout", {str(k): v for k, v in heldout.items()})
    db.close()
    return path


def rule_file(tmp_path: Path, dbs: list[Path], order: str = '["dev_score", "proxy_gap", "heldout_score"]',
              extra: str = "") -> Path:
    listed = ", ".join(f'"{d}"' for d in dbs)
    path = tmp_path / "selection.toml"
    path.write_text(f'order = {order}\n{extra}\n[models."smollm2-135m"]\ndatabases = [{listed}]\n')
    return path


def test_best_dev_score_then_smaller_gap_then_heldout(tmp_path):
    a = database(tmp_path / "a.sqlite", [(50.0, 0.5), (90.0, 0.30), (90.0, 0.20), (80.0, 0.01), (None, None)])
    p = pick(load_rule(rule_file(tmp_path, [a])), "smollm2-135m-instruct")
    assert p.program.id == 3 and p.tied_on_dev == 2 and p.candidates == 4  # 90 ties: the smaller gap wins
    assert p.seed.id == 1
    # on equal dev score and gap the held-out score decides; a missing one counts lowest
    b = database(tmp_path / "b.sqlite", [(50.0, 0.5), (90.0, 0.2), (90.0, 0.2)], heldout={3: 60.0, 1: 70.0})
    p = pick(load_rule(rule_file(tmp_path, [b])), "smollm2-135m-instruct")
    assert p.program.id == 3 and p.heldout == 60.0 and p.seed_heldout == 70.0


def test_the_configs_order_is_what_is_applied(tmp_path):
    a = database(tmp_path / "a.sqlite", [(50.0, 0.5), (90.0, 0.3), (90.0, 0.2)], heldout={2: 80.0, 3: 10.0})
    rule = load_rule(rule_file(tmp_path, [a], '["dev_score", "heldout_score", "proxy_gap"]'))
    assert pick(rule, "smollm2-135m").program.id == 2
    with pytest.raises(ValueError, match="start with dev_score"):
        load_rule(rule_file(tmp_path, [a], '["proxy_gap", "dev_score"]'))
    with pytest.raises(ValueError, match="start with dev_score"):
        load_rule(rule_file(tmp_path, [a], '["dev_score", "test_score"]'))


def test_the_pick_is_compared_with_the_seeds_own_pick_on_the_dev_cells_both_scored(tmp_path, capsys):
    """The margin pairs the dev cells the pick and the seed share: its mean is the mean of their differences (plain
    numpy), the seed is the rule's pick among generation 0 of every pooled database, and a margin whose interval
    holds 0 says so."""
    seed_cells = {"0/0.75": 40.0, "1/0.75": 60.0, "2/0.75": 50.0, "3/0.75": 70.0}
    child_cells = {"0/0.75": 45.0, "1/0.75": 58.0, "2/0.75": 80.0, "3/0.75": 71.0, "9/0.75": 0.0}
    a = tmp_path / "a.sqlite"
    db = ProgramDatabase(a)
    db.set_meta("config", DEV)
    db.set_meta("dtype", "float32")
    for i, (score, cells) in enumerate([(55.0, seed_cells), (63.5, child_cells)]):
        db.add(dict(generation=i, island=0, slot=0, mutator="seed" if i == 0 else "m", status="ok", stage=3,
                    score=score, proxy=0.1, cells=cells, source="def score(f):\n    return f.attn", code_hash=str(i)))
    db.close()
    b = database(tmp_path / "b.sqlite", [(50.0, 0.1)])  # a worse seed in another database: not the comparison
    p = pick(load_rule(rule_file(tmp_path, [b, a])), "smollm2-135m")
    assert (p.program.id, p.database, p.seed.id, p.seed_database) == (2, str(a), 1, str(a))
    differences = np.array([child_cells[k] - seed_cells[k] for k in seed_cells])
    assert p.margin_cells == 4 and p.margin[0] == pytest.approx(differences.mean())
    assert p.margin[1] < 0 < p.margin[2]  # differences 5, -2, 30, 1: the interval holds 0
    assert "pick - seed on dev: +8.50" in format_pick(p) and "not distinguishable" in format_pick(p)
    # the pick is a seed: nothing to compare
    only = pick(load_rule(rule_file(tmp_path, [database(tmp_path / "c.sqlite", [(90.0, 0.1), (80.0, 0.1)])])),
                "smollm2-135m")
    assert only.program.id == only.seed.id == 1 and only.margin is None and "pick - seed" not in format_pick(only)


def seed_and_child(path: Path, child_cells: dict[str, float]) -> Path:
    """A database of a seed (dev cells 40, 60, 50, 70) and one child with ``child_cells``, scored as their means."""
    seed_cells = {"0/0.75": 40.0, "1/0.75": 60.0, "2/0.75": 50.0, "3/0.75": 70.0}
    db = ProgramDatabase(path)
    db.set_meta("config", DEV)
    db.set_meta("dtype", "float32")
    for i, cells in enumerate([seed_cells, child_cells]):
        db.add(dict(generation=i, island=0, slot=0, mutator="seed" if i == 0 else "m", status="ok", stage=3,
                    score=float(np.mean(list(cells.values()))), proxy=0.1, cells=cells,
                    source=f"def score(f):\n    return f.attn  # {i}", code_hash=str(i)))
    db.close()
    return path


def test_keep_seed_within_noise_leaves_the_seed_only_for_a_lead_above_the_noise(tmp_path):
    """With the option, a dev leader whose paired lead over the seed holds 0 (differences 5, -2, 30, 1) is passed
    over for the seed; one ahead on every cell (differences 5, 6, 4, 5: every resample's mean > 0) is kept; without
    the option the leader is the pick either way."""
    noisy = seed_and_child(tmp_path / "noisy.sqlite", {"0/0.75": 45.0, "1/0.75": 58.0, "2/0.75": 80.0, "3/0.75": 71.0})
    clear = seed_and_child(tmp_path / "clear.sqlite", {"0/0.75": 45.0, "1/0.75": 66.0, "2/0.75": 54.0, "3/0.75": 75.0})
    keep = "keep_seed_within_noise = true"
    kept = pick(load_rule(rule_file(tmp_path, [noisy], extra=keep)), "smollm2-135m")
    assert (kept.program.id, kept.passed_over.id, kept.passed_over_database) == (1, 2, str(noisy))
    assert kept.program is kept.seed and kept.margin[1] < 0 < kept.margin[2]
    text = format_pick(kept)
    assert text.startswith("smollm2-135m-instruct: program #1") and "over the dev leader #2" in text
    assert summary(kept)["program"] == 1 and summary(kept)["passed_over"] == 2
    ahead = pick(load_rule(rule_file(tmp_path, [clear], extra=keep)), "smollm2-135m")
    assert ahead.program.id == 2 and ahead.passed_over is None and ahead.margin[1] > 0
    assert pick(load_rule(rule_file(tmp_path, [noisy])), "smollm2-135m").program.id == 2
    with pytest.raises(ValueError, match="keep_seed_within_noise must be true or false, got 'yes'"):
        load_rule(rule_file(tmp_path, [noisy], extra='keep_seed_within_noise = "yes"'))


def test_databases_pool_only_on_one_dev_set(tmp_path):
    a = database(tmp_path / "a.sqlite", [(50.0, 0.5), (90.0, 0.3)])
    b = database(tmp_path / "b.sqlite", [(60.0, 0.5), (90.0, 0.1)])
    p = pick(load_rule(rule_file(tmp_path, [a, b])), "smollm2-135m")
    assert p.database == str(b) and p.program.id == 2 and p.candidates == 4
    c = database(tmp_path / "c.sqlite", [(99.0, 0.0)], dev_seed=2000)  # another dev set: its 99 does not compare
    with pytest.raises(ValueError, match="another dev set.*dev_seed"):
        pick(load_rule(rule_file(tmp_path, [a, c])), "smollm2-135m")
    # a graded (likelihood) dev score is on another scale than a task score: never pooled with one
    d = database(tmp_path / "d.sqlite", [(99.0, 0.0)], fitness="likelihood", dev_cells="alternate")
    with pytest.raises(ValueError, match="another dev set.*dev_cells, fitness"):
        pick(load_rule(rule_file(tmp_path, [a, d])), "smollm2-135m")
    # features over another surrogate are another dev set
    e = database(tmp_path / "e.sqlite", [(99.0, 0.0)], surrogate="runs/my-kvzap")
    with pytest.raises(ValueError, match="another dev set.*surrogate"):
        pick(load_rule(rule_file(tmp_path, [a, e])), "smollm2-135m")


def test_a_pick_over_a_named_surrogate_says_how_to_evaluate_it(tmp_path, capsys):
    e = database(tmp_path / "e.sqlite", [(50.0, 0.5), (99.0, 0.1)], surrogate="runs/my-kvzap")
    assert main(["pick", "--config", str(rule_file(tmp_path, [e])), "--out", str(tmp_path / "out")]) == 0
    assert "scored over the kvzap surrogate runs/my-kvzap" in capsys.readouterr().out
    out = tmp_path / "out" / "smollm2-135m-instruct-picked.py"
    assert f"program(path='{out}', surrogate='runs/my-kvzap')" in out.read_text().splitlines()[1]


def test_the_shipped_rule_picks_from_the_shipped_databases():
    rule = load_rule(REPO / "configs" / "selection.toml")
    for model in rule.databases:
        if not all((REPO / d).is_file() for d in rule.databases[model]):
            pytest.skip("program databases not in this checkout")
    # docs/results.md reports these picks: the v2 evolution's #325 (dev 93.8, 10 programs tie on it, gap 0.160)
    p = pick(rule, "qwen2.5-coder-0.5b-instruct")
    assert (p.program.id, p.database, p.tied_on_dev) == (325, "results/evolve/qwen-v2.sqlite", 10)
    assert p.program.proxy == pytest.approx(0.160, abs=5e-4) and p.heldout == pytest.approx(63.75)
    assert pick(rule, "smollm2-135m-instruct").program.id == 32


def test_cli_prints_the_pick_writes_it_and_counts_the_exploratory_policies(tmp_path, capsys):
    a = database(tmp_path / "a.sqlite", [(50.0, 0.5), (90.0, 0.3)])
    store = tmp_path / "s.sqlite"
    with ResultsStore(store) as s:
        for policy in ("full", "tova", "program:x.py", "kvzap(checkpoint='m')"):
            s.add(CellResult(CellKey("smollm2-135m-instruct", "t", 512, "0", policy, 0.5, False), "p", 1.0, ["a"], 1,
                             1, 1, 0.0, 0.0, {}))
    assert exploratory(store, "smollm2-135m") == {"found_or_learned": ["kvzap(checkpoint='m')", "program:x.py"],
                                                 "baselines": ["tova"]}
    assert main(["pick", "--config", str(rule_file(tmp_path, [a])), "--out", str(tmp_path / "out"),
                 "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "program #2" in out and "dev score 90.0" in out and "2 found or learned policies and 1 baselines" in out
    written = (tmp_path / "out" / "smollm2-135m-instruct-picked.py").read_text()
    assert written.startswith("# picked by the selection rule") and "# 2" in written


def test_write_pick_without_a_gap(tmp_path):
    a = database(tmp_path / "a.sqlite", [(50.0, None)])
    p = pick(load_rule(rule_file(tmp_path, [a])), "smollm2-135m")
    text = write_pick(p, tmp_path, "configs/rule-x.toml").read_text()
    assert "gap nan" in text and text.startswith("# picked by the selection rule (configs/rule-x.toml)")


def test_the_demo_runs_the_rules_smollm2_pick():
    from kvsieve.cli import DEMO, DEMO_PICK
    from kvsieve.harness.grid import GridConfig
    from kvsieve.language.shipped_programs import program_file

    rule = load_rule(REPO / "configs" / "selection.toml")
    if not all((REPO / d).is_file() for d in rule.databases["smollm2-135m-instruct"]):
        pytest.skip("program databases not in this checkout")
    p = pick(rule, "smollm2-135m-instruct")
    shipped = program_file(DEMO_PICK.removeprefix("program:")).read_text()  # a shipped program, by name
    assert shipped.split("\n", 1)[1].strip() == (p.program.source or "").strip()  # the header aside, the same program
    assert DEMO_PICK in [spec.text for spec in GridConfig(**DEMO).policies]


def test_a_seed_program_read_from_a_file_says_which_file(tmp_path):
    """A program seeded from a file (``seed_programs``) gets the new database's next id: the file's name may carry
    its number in the database it came from, so the printout names the file beside the one number it gives."""
    path = tmp_path / "a.sqlite"
    db = ProgramDatabase(path)
    db.set_meta("config", DEV)
    db.set_meta("dtype", "float32")
    for slot, (operation, score) in enumerate([("snapkv", 40.0), ("runs/candidates/02-study-s4-38-floor40.py", 60.0)]):
        db.add(dict(generation=0, island=0, slot=slot, mutator="seed", operation=operation, status="ok", stage=3,
                    score=score, proxy=0.1, source=f"def score(f):\n    return f.attn  # {slot}", code_hash=str(slot)))
    db.close()
    p = pick(load_rule(rule_file(tmp_path, [path])), "smollm2-135m")
    assert p.program.id == 2
    lines = format_pick(p).split("\n")
    assert lines[0] == f"smollm2-135m-instruct: program #2 of {path} (generation 0, island 0)"
    assert lines[1] == "  a seed program, read from runs/candidates/02-study-s4-38-floor40.py"
    # a built-in seed (a name) or a child names no file
    named = pick(load_rule(rule_file(tmp_path, [database(tmp_path / "b.sqlite", [(90.0, 0.1), (80.0, 0.1)])])),
                 "smollm2-135m")
    assert "read from" not in format_pick(named)


def test_the_readme_names_qwens_pick_as_kvsieve_pick_prints_it():
    """The README named the floor rule's pick "#38", its id in the 2k study's database, where ``kvsieve pick``
    prints "#3 of .../floor-high.sqlite": one number, the database's id, with the database it counts in."""
    rule = load_rule(REPO / "configs" / "selection-floor-high-qwen-4k.toml")
    if not all((REPO / d).is_file() for d in rule.databases["qwen2.5-coder-0.5b-instruct"]):
        pytest.skip("program databases not in this checkout")
    p = pick(rule, "qwen2.5-coder-0.5b-instruct")
    first = format_pick(p).split("\n")[0]
    readme = " ".join((REPO / "README.md").read_text().split())  # the README's line breaks as spaces
    said = f"program #{p.program.id} of {p.database}"
    assert said in first and f"`{said}`" in readme, said
    assert "picks #38" not in readme
