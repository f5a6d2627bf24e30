"""Programs and checkpoints by name: `program:NAME` and `checkpoint='NAME'` resolve through the shipped tables, and a
spec naming a file by its path is keyed by the name whose bytes the file has, so moving or copying a file never
changes the key its rows are stored under (issue 71)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from kvsieve.bundled import canonical_name
from kvsieve.language.shipped_programs import PROGRAM_DIR, PROGRAMS, program_file, program_name
from kvsieve.networks.shipped import CHECKPOINT_DIR, NAMED, SHIPPED, resolve_checkpoint, shipped_files
from kvsieve.policies import parse
from kvsieve.policies.program import ProgramPolicy
from kvsieve.risk.losses import candidates_for

ROOT = Path(__file__).resolve().parents[2]
REFINED = "qwen2.5-coder-0.5b-instruct-signal-fit-affine"
REFINED_RUN = ROOT / "results/learned/issue51/signal-fit-affine-qwen-s5000"
FLOOR_HIGH = ROOT / "results/evolve/picked-floor-high-qwen-4k/qwen2.5-coder-0.5b-instruct-picked.py"
GRADED_REFINED = ROOT / "results/evolve/picked-graded-refined/qwen2.5-coder-0.5b-instruct-picked.py"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_named_program_is_the_file_its_pick_wrote():
    assert len({sha(PROGRAM_DIR / p.file) for p in PROGRAMS.values()}) == len(PROGRAMS)  # one name a program
    for name, entry in PROGRAMS.items():
        assert entry.name == name and (PROGRAM_DIR / entry.file).is_file()
        assert canonical_name(entry.model) == entry.model
        assert (ROOT / entry.rule).is_file(), entry.rule  # the rule kvsieve pick applied
        origin = ROOT / entry.origin
        if origin.is_file():  # the file kvsieve pick wrote under results/, byte for byte
            assert sha(origin) == sha(PROGRAM_DIR / entry.file), name
        header = (PROGRAM_DIR / entry.file).read_text().splitlines()[0]
        assert f"{entry.rule.split('/')[-1]}): {entry.picked}," in header, name
        assert len(entry.commit) == 40
        if entry.surrogate is not None:
            assert resolve_checkpoint("kvzap", entry.surrogate).is_file()


def test_a_program_is_named_by_name_and_its_file_by_path():
    assert program_file("qwen-pick-floor-high") == PROGRAM_DIR / PROGRAMS["qwen-pick-floor-high"].file
    assert program_file("results/x.py") == Path("results/x.py")  # not a name: the path
    assert program_name(FLOOR_HIGH) == "qwen-pick-floor-high"
    assert program_name(GRADED_REFINED.with_name("missing.py")) is None


def test_a_named_program_builds_and_is_keyed_by_its_name():
    by_name = parse("program:qwen-pick-floor-high")
    assert by_name.text == "program:qwen-pick-floor-high"
    policy = by_name.build()
    assert isinstance(policy, ProgramPolicy) and policy.reads_surrogate
    assert policy.program.selection_params["floor"] == 40
    # the same bytes, the same digest: rows stored before the name existed are these rows
    assert by_name.digest == parse(f"program:{FLOOR_HIGH.relative_to(ROOT)}").digest


def test_a_path_to_a_named_program_is_keyed_by_its_name_wherever_the_file_lies(tmp_path):
    assert parse(f"program:{FLOOR_HIGH}").text == "program:qwen-pick-floor-high"
    moved = tmp_path / "elsewhere.py"
    shutil.copyfile(FLOOR_HIGH, moved)
    spec = parse(f"program:{moved}")
    assert spec.text == "program:qwen-pick-floor-high"
    assert spec.digest == parse("program:qwen-pick-floor-high").digest
    moved.write_text(moved.read_text() + "\n# edited\n")  # other bytes: another program, keyed by its path
    assert parse(f"program:{moved}").text == f"program:{moved}"


def test_the_refined_surrogate_is_a_named_checkpoint():
    path = resolve_checkpoint("kvzap", REFINED)
    assert path == CHECKPOINT_DIR / NAMED[REFINED][1] and NAMED[REFINED][0] == "kvzap"
    assert sha(path) == sha(REFINED_RUN / "policy.safetensors")  # the declared seed-5000 run's file, unchanged
    spec = parse(f"kvzap(checkpoint='{REFINED}')")
    assert spec.text == f"kvzap(checkpoint='{REFINED}')" and spec.digest == sha(path)
    assert spec.build().trained_for.name == "qwen2.5-coder-0.5b-instruct"
    # given by its run's folder or file, it is keyed by its name
    for given in (REFINED_RUN, REFINED_RUN / "policy.safetensors"):
        assert parse(f"kvzap(checkpoint='{given.relative_to(ROOT)}')").text == f"kvzap(checkpoint='{REFINED}')"
    with pytest.raises(ValueError, match="neither a file"):
        resolve_checkpoint("learned", REFINED)  # a kvzap checkpoint: no learned policy reads it


def test_a_named_checkpoint_is_never_a_models_default():
    """The model's surrogate a program reads without surrogate= stays the shipped default, so the keys and digests of
    every row stored before the named checkpoint existed are unchanged."""
    assert shipped_files("kvzap") == tuple(CHECKPOINT_DIR / SHIPPED["kvzap", m] for m in sorted(
        m for family, m in SHIPPED if family == "kvzap"))
    assert all(CHECKPOINT_DIR / file not in shipped_files(family) for family, file in NAMED.values())


def test_a_program_over_the_refined_surrogate_by_paths_is_keyed_by_both_names():
    old = (f"program(path='{GRADED_REFINED.relative_to(ROOT)}', "
           f"surrogate='{REFINED_RUN.relative_to(ROOT)}')")
    new = f"program(path='qwen-pick-graded-refined', surrogate='{REFINED}')"
    assert parse(old).text == new
    assert parse(new).text == new and parse(new).digest == parse(old).digest
    assert PROGRAMS["qwen-pick-graded-refined"].surrogate == REFINED
    policy = parse(new).build()
    assert policy.surrogate is not None and policy.surrogate.checkpoint.endswith(NAMED[REFINED][1])


def test_a_certified_candidate_given_by_path_reads_the_rows_of_its_name():
    (cand,) = candidates_for([f"program:{FLOOR_HIGH}"], [0.875])
    assert cand.stored == "program:qwen-pick-floor-high"
    (kept,) = candidates_for(["program:missing.py"], [0.875])  # no file here: as given, for the store to refuse
    assert kept.stored == "program:missing.py"


def test_other_files_keep_their_path_and_a_spec_its_text(tmp_path):
    program = tmp_path / "best.py"
    program.write_text('SELECTION = {"allocation": "global", "normalization": "none"}\n\n\n'
                       "def score(f):\n    return f.key_norm\n")
    assert parse(f"program:{program}").text == f"program:{program}"
    text = f'program(path="{program}", deadline_s=5.0)'  # unchanged: not re-rendered in another quoting
    assert parse(text).text == text
    assert parse("kvzap(checkpoint='qwen2.5-0.5b')").text == "kvzap(checkpoint='qwen2.5-0.5b')"  # a name stays
