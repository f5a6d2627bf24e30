"""FRC against a plain re-derivation of its documented formula, and evolved program files as policies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_reference_policies import (
    RATIOS,
    D,
    H,
    N,
    W,
    avg_pool_zero_padded,
    budget_of,
    kvsieve_keeps,
    np64,
    random_inputs,
    signals_for,
    window_attention,
)

from kvsieve.evolve.seeds import SEEDS
from kvsieve.language.program_features import Features
from kvsieve.policies import from_spec, get, parse_spec


def frc_scores_ref(window_att: np.ndarray, h: int, kernel: int = 9, weights=(0.4, 0.4, 0.2)) -> np.ndarray:
    """FRC as its docstring states it, with loops: L = window attention summed over the window queries,
    averaged over the group; D = L averaged over a centred neighbourhood of 9, zero padded; M = the max
    over the group; each divided by its mean over the entries; 0.4 L + 0.4 D + 0.2 M."""
    hq, _, n = window_att.shape
    g = hq // h
    received = window_att.sum(axis=1).reshape(h, g, n)
    out = np.zeros((h, n))
    for head in range(h):
        local = received[head].mean(axis=0)
        density = avg_pool_zero_padded(local, kernel)
        head_max = received[head].max(axis=0)
        parts = [x / x.mean() for x in (local, density, head_max)]
        out[head] = sum(w * p for w, p in zip(weights, parts))
    return out


def chunk_keep_ref(scores: np.ndarray, kept: int, window: int, chunk: int) -> set[int]:
    """Whole chunks of ``chunk`` from the first entry, best mean first, plus the window."""
    n = len(scores)
    n_chunks = (n - window) // chunk
    means = [scores[c * chunk : (c + 1) * chunk].mean() for c in range(n_chunks)]
    best = sorted(range(n_chunks), key=lambda c: -means[c])[: (kept - window) // chunk]
    return set(range(n - window, n)) | {i for c in best for i in range(c * chunk, (c + 1) * chunk)}


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("seed", [0, 3])
def test_frc_keeps_the_chunks_its_formula_ranks_first(ratio, seed):
    inputs = random_inputs(seed)
    scores = frc_scores_ref(window_attention(np64(inputs[0][0]), np64(inputs[2][0]), D**-0.5), H)
    kept = budget_of(N, ratio)
    got = kvsieve_keeps(get("frc", window=W), signals_for(inputs), kept, N)
    for head in range(H):
        assert got[head] == chunk_keep_ref(scores[head], kept, W, 4), (head, sorted(got[head]))


def test_frc_head_max_differs_from_the_group_mean():
    """The max over the group is a signal of its own: a head read by one query head scores above the mean."""
    inputs = random_inputs(2)
    window_att = window_attention(np64(inputs[0][0]), np64(inputs[2][0]), D**-0.5)
    with_max = frc_scores_ref(window_att, H)
    without = frc_scores_ref(window_att, H, weights=(0.4 / 0.8, 0.4 / 0.8, 0.0))
    got = np64(get("frc", window=W).score(signals_for(inputs))[0])
    np.testing.assert_allclose(got, with_max, rtol=1e-4)
    assert not np.allclose(got, without, rtol=1e-3)


def test_frc_seed_program_equals_the_frc_policy(tmp_path):
    """The evolution's FRC seed, run as a program file, scores and keeps exactly as the shipped policy."""
    path = tmp_path / "frc.py"
    path.write_text(SEEDS["frc"])
    program = from_spec(f"program:{path}")
    policy = get("frc")
    signals = signals_for(random_inputs(7))
    torch.testing.assert_close(program.score(signals), policy.score(signals), rtol=1e-5, atol=1e-6)
    assert program.selection.chunk_size == policy.selection.chunk_size == 4
    assert program.selection.recent == policy.selection.recent == 64


def test_features_match_the_signals():
    inputs = random_inputs(1)
    signals = signals_for(inputs)
    features = Features.from_signals(signals)
    window_att = window_attention(np64(inputs[0][0]), np64(inputs[2][0]), D**-0.5)  # (hq, w, n)
    np.testing.assert_allclose(np64(features.attn[0]), window_att.sum(axis=1).reshape(H, -1, N), rtol=1e-4)
    np.testing.assert_allclose(np64(features.last_attn[0]), window_att[:, -1].reshape(H, -1, N), rtol=1e-4)
    np.testing.assert_allclose(np64(features.key_norm[0]), np.linalg.norm(np64(inputs[0][0]), axis=-1), rtol=1e-5)
    assert features.position[0] == 0 and features.position[-1] == 1
    assert (features.n, features.window, features.group, features.layer) == (N, W, 3, 0.5)


def test_program_spec_errors_name_the_problem(tmp_path):
    assert parse_spec("program:best.py") == ("program", {"path": "best.py"})
    with pytest.raises(ValueError, match="does not exist"):
        from_spec(f"program:{tmp_path / 'missing.py'}")
    with pytest.raises(ValueError, match="program:PATH"):
        from_spec("program:")
    hostile = tmp_path / "hostile.py"
    hostile.write_text("import os\n\ndef score(f):\n    return f.key_norm\n")
    with pytest.raises(ValueError, match="import"):
        from_spec(f"program:{hostile}")
    wrong_shape = tmp_path / "wrong.py"
    wrong_shape.write_text("def score(f):\n    return f.attn\n")
    with pytest.raises(ValueError, match=r"wrong.py line 2: score must return scores shaped \(b, h, n\), this returns "
                                         r"\(b, h, g, n\)"):
        from_spec(f"program:{wrong_shape}")  # refused when the spec is built: the type is known before any run
