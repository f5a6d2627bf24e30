"""Evolution end to end on a tiny random model: structural mutator, cascade, database, resume after kill -9."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvsieve.evolve.database import ProgramDatabase, behaviour_cell
from kvsieve.evolve.features import synthetic_features
from kvsieve.evolve.interpreter import ScoreProgram
from kvsieve.evolve.mutate import OPERATIONS, StructuralMutator
from kvsieve.evolve.program import Program, ProgramError, parse_selection
from kvsieve.evolve.search import EvolveConfig, load_config
from kvsieve.evolve.seeds import SEEDS
from kvsieve.evolve.static import check_source

HERE = os.path.dirname(__file__)


def tiny_run_config(tmp, candidates: int, **changes) -> EvolveConfig:
    values = dict(model="smollm2-135m-instruct", tasks=["niah_single_1"], length=384, ratios=[0.75],
                  dev_samples=2, heldout_samples=1, window=16, candidates=candidates, islands=2, per_island=2,
                  migration_interval=2, seed_programs=["snapkv", "tova"], sandbox_timeout_s=60,
                  db=str(tmp / "run.sqlite"), out=str(tmp / "out"))
    values.update(changes)
    return EvolveConfig(**values)


def tiny_model_and_tokenizer():
    from kvsieve.models import load

    _, tokenizer = load("smollm2-135m-instruct", dtype="float32")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval(), tokenizer


def run_tiny(tmp: str, candidates: int) -> None:
    """Entry point of the subprocess the kill test starts."""
    from pathlib import Path

    from kvsieve.evolve.run import run_evolution

    model, tokenizer = tiny_model_and_tokenizer()
    run_evolution(tiny_run_config(Path(tmp), candidates), progress=False, model=model, tokenizer=tokenizer)


def rows(db_path) -> list[tuple]:
    db = ProgramDatabase(db_path)
    try:
        return [(r.generation, r.island, r.slot, r.code_hash, r.status, r.parent_id is None, r.score,
                 None if r.proxy is None else round(r.proxy, 5)) for r in db.records()]
    finally:
        db.close()


# --- structural mutator ------------------------------------------------------------------------------


def test_structural_mutations_are_valid_programs_and_reproducible():
    mutator = StructuralMutator()
    parent, other = Program(SEEDS["snapkv"]), Program(SEEDS["frc"])
    features = synthetic_features(3)
    seen_ops, children = set(), []
    for i in range(120):
        child = mutator.propose(parent, [other], random.Random(i))
        assert child is not None
        check_source(child.source)  # every child passes stage 0
        scores = ScoreProgram(child.source)(features)
        assert tuple(scores.shape) == features.score_shape
        seen_ops.add(mutator.last_operation)
        children.append(child.source)
        if i % 4 == 0:
            parent = child
    assert seen_ops == set(OPERATIONS)
    again = StructuralMutator()
    parent = Program(SEEDS["snapkv"])
    for i in range(120):
        child = again.propose(parent, [other], random.Random(i))
        assert child.source == children[i]
        if i % 4 == 0:
            parent = child


def test_crossover_keeps_both_parents_signals():
    mutator = StructuralMutator(operations=("crossover",))
    child = mutator.propose(Program(SEEDS["tova"]), [Program(SEEDS["frc"])], random.Random(0))
    assert "f.last_attn" in child.source and "f.attn" in child.source
    assert behaviour_cell(child.source).startswith("signals2")


def test_selection_parameters_are_checked():
    assert parse_selection(SEEDS["frc"]) == {"chunk_size": 4, "sink": 0}
    with pytest.raises(ProgramError, match="outside the allowed"):
        parse_selection('SELECTION = {"chunk_size": 0}\n')
    with pytest.raises(ProgramError, match="unknown SELECTION key"):
        parse_selection('SELECTION = {"recent": 4}\n')


def test_config_files_reject_unknown_keys_and_bad_values(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('candidates = 5\nislandz = 3\n')
    with pytest.raises(ValueError, match="islandz"):
        load_config(str(path))
    path.write_text('candidates = 5\nmutator = "gpt"\n')
    with pytest.raises(ValueError, match="'gpt'"):
        load_config(str(path))
    path.write_text('candidates = 7\n')
    assert load_config(str(path), seed=3).candidates == 7


# --- end to end --------------------------------------------------------------------------------------


@pytest.mark.model
def test_evolution_runs_end_to_end_and_resumes_after_kill(tmp_path):
    """A run killed with SIGKILL mid-run and resumed stores exactly the rows of an uninterrupted run."""
    from kvsieve.evolve.run import run_evolution

    model, tokenizer = tiny_model_and_tokenizer()
    straight = tmp_path / "straight"
    result = run_evolution(tiny_run_config(straight, 8), progress=False, model=model, tokenizer=tokenizer)
    expected = rows(straight / "run.sqlite")
    evaluated = [r for r in expected if r[4] not in ("duplicate", "no_proposal", "migrated")]
    assert len(evaluated) == 8
    assert {r[4] for r in evaluated} <= {"ok", "proxy_rejected", "invalid", "error", "rejected", "killed"}
    assert result.best_path is not None and result.best_path.is_file()
    check_source(result.best_path.read_text())
    report = result.report.read_text()
    assert "Evaluated candidates: 8" in report and (straight / "out" / "progress.png").is_file()
    # the exported program is a policy file the registry loads
    from kvsieve.policies import from_spec

    assert from_spec(f"program:{result.best_path}").name == "program"

    killed = tmp_path / "killed"
    killed.mkdir()
    code = f"import sys; sys.path.insert(0, {HERE!r}); from test_evolve import run_tiny; run_tiny(sys.argv[1], 8)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(killed)], stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.3)
        if (killed / "run.sqlite").exists() and len(rows(killed / "run.sqlite")) >= 6:
            break
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = rows(killed / "run.sqlite")
    assert 0 < len(partial) < len(expected)
    run_evolution(tiny_run_config(killed, 8), progress=False, model=model, tokenizer=tokenizer)
    assert rows(killed / "run.sqlite") == expected


def test_a_database_refuses_another_run(tmp_path):
    db = ProgramDatabase(tmp_path / "x.sqlite")
    db.check_config(tiny_run_config(tmp_path, 5).identity())
    db.add(dict(generation=0, island=0, slot=0, mutator="seed", status="ok", stage=3))
    db.check_config(tiny_run_config(tmp_path, 9).identity())  # more candidates: the same run, resumed
    with pytest.raises(ValueError, match="seed: 0 -> 1"):
        db.check_config(tiny_run_config(tmp_path, 5, seed=1).identity())
    db.close()


def test_a_run_that_stored_nothing_takes_the_corrected_config(tmp_path):
    """A run that failed before its first row (a typo) does not make the corrected rerun refuse."""
    db = ProgramDatabase(tmp_path / "x.sqlite")
    db.check_config(tiny_run_config(tmp_path, 5, tasks=["niah_single_9"]).identity())
    db.check_config(tiny_run_config(tmp_path, 5).identity())
    assert json.loads(db.conn.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()[0])["tasks"] == [
        "niah_single_1"]
    db.close()


def test_bad_databases_and_configs_are_refused_up_front(tmp_path):
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(ValueError, match="junk.sqlite.*is not a kvsieve SQLite database"):
        ProgramDatabase(junk)
    with pytest.raises(ValueError, match="heldout_samples must be an int >= 1, got 0"):
        tiny_run_config(tmp_path, 5, heldout_samples=0)
    path = tmp_path / "c.toml"
    path.write_text("candidates = [\n")
    with pytest.raises(ValueError, match="c.toml: cannot read"):
        load_config(str(path))
    path.write_text("sandbox = 'loose'\n")
    with pytest.raises(ValueError, match="c.toml: sandbox must be 'default' or 'strict'"):
        load_config(str(path))
