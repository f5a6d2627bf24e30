"""The mixed mutator (structural edits or grafts of random terms) and the study's mixed arms (issue 50)."""

from __future__ import annotations

import ast
import random
import re
from collections import Counter

import pytest

from kvsieve.evolve.evolve_config import EvolveConfig
from kvsieve.evolve.mutators import MixedMutator, make_mutator
from kvsieve.evolve.mutators.structural import KERNELS, OPERATIONS, TERMS
from kvsieve.evolve.seeds import SEEDS
from kvsieve.language.interpreter import ScoreProgram
from kvsieve.language.program_features import synthetic_features
from kvsieve.language.program_source import Program
from kvsieve.language.static_check import check_source

# one random term, written out here from the documented vocabulary: WEIGHT * SCALE(SIGNAL), the kernel any of KERNELS
_KERNELS = "(?:" + "|".join(map(str, KERNELS)) + ")"
_SIGNALS = "|".join(_KERNELS.join(re.escape(part) for part in re.split(r"(?<=, )\d+(?=\))", t)) for t in TERMS)
TERM = rf"(?:0\.1|0\.2|0\.3|0\.5|1\.0) \* (?:unit_mean|normalize|rank)\((?:{_SIGNALS})\)"


def _return_text(source: str) -> str:
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    return ast.unparse(fn.body[-1].value)


def _selection(source: str) -> dict:
    return dict(Program(source).selection_params)


@pytest.mark.parametrize("seed_name", ["snapkv", "frc", "surrogate"])
def test_every_mixed_proposal_passes_stage_0_and_runs_on_synthetic_features(seed_name):
    """Every child the language accepts, scores the synthetic features at the score's shape; a chain of children
    (each fourth the next parent, as selection would) stays valid; the same rng gives the same child."""
    parent, other = Program(SEEDS[seed_name]), Program(SEEDS["tova"])
    features = synthetic_features(3)
    mutator, children = MixedMutator(), []
    for i in range(80):
        child = mutator.propose(parent, [other], random.Random(i))
        assert child is not None and child.code_hash != parent.code_hash
        check_source(child.source)
        child.selection_params  # noqa: B018 - a SELECTION the selection accepts
        assert tuple(ScoreProgram(child.source)(features).shape) == features.score_shape
        children.append((child.source, mutator.last_operation))
        if i % 4 == 0:
            parent = child
    again, parent = MixedMutator(), Program(SEEDS[seed_name])
    for i in range(80):
        child = again.propose(parent, [other], random.Random(i))
        assert (child.source, again.last_operation) == children[i]
        if i % 4 == 0:
            parent = child
    assert mutator.failed == 0


def test_grafts_replace_the_return_or_one_part_by_random_terms_and_keep_the_selection():
    """A 'random_return' child returns a sum of one to three terms of the random arm's vocabulary (checked against
    a pattern written from that vocabulary); a 'graft' child contains one such term where the parent had none of
    it; both keep the parent's SELECTION. Structural children carry the structural operation's name."""
    parent = Program(SEEDS["frc"])
    ops: Counter = Counter()
    for i in range(300):
        mutator = MixedMutator()
        child = mutator.propose(parent, [Program(SEEDS["tova"])], random.Random(i))
        op = mutator.last_operation
        ops[op] += 1
        if op == "random_return":
            assert re.fullmatch(rf"{TERM}(?: \+ {TERM}){{0,2}}", _return_text(child.source)), child.source
            assert _selection(child.source) == _selection(parent.source)
        elif op == "graft":
            new_terms = set(re.findall(TERM, child.source)) - set(re.findall(TERM, parent.source))
            assert new_terms, child.source
            assert _selection(child.source) == _selection(parent.source)
        else:
            assert op in OPERATIONS
    grafts = ops["graft"] + ops["random_return"]
    # RANDOM_SHARE = 0.5 (nearly every graft is accepted): 300 Bernoulli(0.5) draws lie in [120, 180] with
    # probability > 0.999; WHOLE_SHARE = 0.5 splits the grafts
    assert 120 <= grafts <= 180, ops
    assert 0.3 * grafts <= ops["random_return"] <= 0.7 * grafts, ops


def test_random_share_0_is_the_structural_mutator_and_1_grafts_only():
    from kvsieve.evolve.mutators.structural import StructuralMutator

    parent = Program(SEEDS["snapkv"])
    only_random = MixedMutator(random_share=1.0)
    for i in range(40):
        rng = random.Random(f"x{i}")
        rng.random()  # the mixed mutator's first draw decides graft or edit; the rest is the structural edit's
        structural = StructuralMutator().propose(parent, [], rng)
        assert MixedMutator(random_share=0.0).propose(parent, [], random.Random(f"x{i}")).source == structural.source
        only_random.propose(parent, [], random.Random(i))
        assert only_random.last_operation in ("graft", "random_return")
    with pytest.raises(ValueError, match="random_share must be in"):
        MixedMutator(random_share=1.5)


def test_the_config_names_the_mixed_mutator():  # the study's mixed arms: tests/benchmarks/test_study_runs.py
    assert isinstance(make_mutator(EvolveConfig(mutator="mixed")), MixedMutator)
    with pytest.raises(ValueError, match="'mixed'"):
        EvolveConfig(mutator="mix")
