"""A candidate's own deadline (issue 72): a priced program that runs far past its price is the candidate's failure,
stored with its reason (predicted and measured time), never retried and never ``SandboxUnavailable``; the
evolution goes on. The slowness is a trusted loader's (``sandbox_slow_loader.py``): the language itself has no
known slow path left (tests/language/test_values.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from conftest import CharTokenizer, tiny_model

from kvsieve.evolve import cascade, sandbox
from kvsieve.evolve.candidate_executor import LocalExecutor
from kvsieve.evolve.cascade import DevSet
from kvsieve.evolve.database import ProgramDatabase
from kvsieve.evolve.evolve_config import EvolveConfig
from kvsieve.evolve.mutators import make_mutator
from kvsieve.evolve.sandbox import SandboxLimits, run_in_sandbox
from kvsieve.evolve.search import evolve
from kvsieve.tasks.sample import Sample

SLOW = str(Path(__file__).with_name("sandbox_slow_loader.py"))
HOSTILE = '"""Cheap by its price, slow in fact."""\nSELECTION = {"chunk_size": 1, "sink": 2}\n\n\ndef score(f):\n' \
          "    return torch.tanh(f.key_norm) + pool(group_mean(f.attn), 3)\n"
# the deadline: 10 x predicted + 1 s, about 1.2 s here; the slow loader adds 0.5 s to each of its 8 or more calls
LIMITS = SandboxLimits(timeout_s=60.0, memory_mb=2048, deadline_slack_s=1.0)


def test_a_run_past_its_deadline_is_the_candidates_failure_and_is_not_retried(monkeypatch):
    attempts = []
    attempt = sandbox._attempt
    monkeypatch.setattr(sandbox, "_attempt", lambda *a, **k: attempts.append(1) or attempt(*a, **k))
    result = run_in_sandbox(HOSTILE, window=8, limits=LIMITS, layers={"raw_loader": SLOW})
    assert result.status == "killed" and len(attempts) == 1, (result.status, result.reason, attempts)
    assert "ran past its deadline" in result.reason and "predicted" in result.reason, result.reason
    killed_after = float(result.reason.split("killed after ")[1].split(" s")[0])
    predicted = float(result.reason.split("against ")[1].split(" s predicted")[0])
    deadline = float(result.reason.split("(deadline ")[1].split(" s")[0])
    assert 0 < predicted < 0.1 and abs(deadline - (10 * predicted + 1.0)) < 0.02
    assert deadline <= killed_after < deadline + 2.0
    # the same program interpreted as kvsieve does finishes far inside its deadline
    assert run_in_sandbox(HOSTILE, window=8, limits=LIMITS).status == "ok"


def test_a_priced_program_past_the_sandboxs_timeout_is_killed_once_not_retried_into_sandbox_unavailable(monkeypatch):
    """Issue 72's scenario: the timeout was an infrastructure guard, so a cheap-priced program that ran past it was
    retried three times and then raised SandboxUnavailable, which stopped `kvsieve evolve`. Now the deadline (capped
    at the timeout) is the candidate's: one run, killed, with its times."""
    attempts = []
    attempt = sandbox._attempt
    monkeypatch.setattr(sandbox, "_attempt", lambda *a, **k: attempts.append(1) or attempt(*a, **k))
    limits = SandboxLimits(timeout_s=2.0, memory_mb=2048)  # the default deadline (10 x + 5 s) is capped at 2 s
    result = run_in_sandbox(HOSTILE, window=8, limits=limits, layers={"raw_loader": SLOW})
    assert (result.status, len(attempts)) == ("killed", 1), (result.status, result.reason)
    assert "capped at the sandbox's timeout" in result.reason and "(deadline 2.00 s" in result.reason, result.reason


def test_an_evolution_with_a_hostile_slow_program_finishes_with_it_failed_and_stored(tmp_path, monkeypatch):
    torch.manual_seed(0)
    hostile = tmp_path / "hostile.py"
    hostile.write_text(HOSTILE)
    slow = functools.partial(run_in_sandbox, layers={"raw_loader": SLOW})
    # the hostile program (and only it) runs through the slow loader, wherever the cascade sends it
    monkeypatch.setattr(cascade, "run_in_sandbox",
                        lambda source, *a, **k: (slow if source == HOSTILE else run_in_sandbox)(source, *a, **k))
    samples = [Sample(id=f"d{i}", task="niah_single_1", context=f"the number is {n}. " * 6 + "and so on. " * i,
                      question="Which number?", answer_prefix="It is", answers=[str(n)], max_new_tokens=4, length=0,
                      seed=i, metric="string_match_all") for i, n in enumerate((4711, 2024))]
    dev = DevSet(tiny_model("llama"), CharTokenizer(), samples, ratios=[0.75], window=4, workdir=tmp_path / "dev")
    config = EvolveConfig(model="tiny", tasks=["niah_single_1"], length=384, ratios=[0.75], dev_samples=2,
                          heldout_samples=1, window=4, candidates=4, islands=1, per_island=2,
                          seed_programs=[str(hostile), "snapkv"], db=str(tmp_path / "run.sqlite"),
                          out=str(tmp_path / "out"))
    db = ProgramDatabase(config.db)
    try:
        evolve(config, LocalExecutor(dev, LIMITS), make_mutator(config), db, progress=False)
        records = db.records("1 = 1")
    finally:
        db.close()
    first, *rest = records
    assert first.source == HOSTILE and first.status == "killed", (first.status, first.reason)
    assert "ran past its deadline" in first.reason and "predicted" in first.reason
    # the other seed and a generation of children were evaluated after it: the run went on to its 4 candidates
    evaluated = [r for r in rest if r.status != "duplicate"]
    assert len(evaluated) == 3 and rest[0].operation == "snapkv" and rest[0].status == "ok", [
        (r.operation, r.status, r.reason) for r in rest]
    assert all(r.status != "killed" for r in evaluated)
