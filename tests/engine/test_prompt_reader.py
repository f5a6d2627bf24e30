"""The prompt reader under every verb: eval, ``generate`` and the server's prefill keep bit for bit the same entries
and give the same answer on SmolLM2, for every shipped policy, as the three separate paths did before the reader
replaced them (pinned in ``pinned_reads.json`` by ``python tests/engine/paths_equal.py --pin`` at e9da4e6)."""

from __future__ import annotations

import json

import pytest
import torch
from paths_equal import PATHS, PINNED, machine, specs

from kvsieve.evolve.seeds import SEEDS

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the pinned digests were taken at one thread: float sums follow the thread count
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("program") / "frc.py"
    path.write_text(SEEDS["frc"])
    return path


CASES = [(spec, qa) for spec, qa in specs("SEED_FRC")]


@pytest.mark.parametrize(("spec", "question_aware"), CASES, ids=[f"{s}{'+qa' if q else ''}" for s, q in CASES])
def test_every_verb_keeps_and_answers_as_before(smollm2, one_thread, program, spec, question_aware):
    model, tokenizer = smollm2
    pinned = json.loads(PINNED.read_text())
    real = spec.replace("SEED_FRC", str(program))
    got = {}
    for name, run in PATHS.items():
        if spec == "oracle" and name != "eval":
            continue
        got[name] = run(model, tokenizer, real, question_aware)
    # the three verbs agree with each other on any machine
    assert len({json.dumps(row, sort_keys=True) for row in got.values()}) == 1, got
    if pinned["machine"] != machine():
        pytest.skip(f"pinned on {pinned['machine']!r}, this is {machine()!r}: float32 kernels differ")
    for name, row in got.items():
        assert row == pinned["rows"][f"{name} {spec}{' +qa' if question_aware else ''}"], name
