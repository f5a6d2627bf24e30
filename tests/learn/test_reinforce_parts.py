"""The parts of issue 51's REINFORCE, each against an independent derivation: the leave-one-out baseline (numpy),
the budget curriculum (hand values), the trust region's first-draw KL (numpy), the stopping rule (a hand-run
sequence) and the paired interval (numpy mean)."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the headless backend

from kvsieve.learn.baselines import leave_one_out
from kvsieve.learn.curriculum import active_ratios
from kvsieve.learn.heldout import mean_by_step, paired_interval
from kvsieve.learn.reinforce import curve_figure
from kvsieve.learn.stopping import StoppingRule
from kvsieve.learn.trust_region import first_draw_kl


def test_leave_one_out_is_the_mean_of_the_other_rollouts_returns():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(5, 3))  # 5 rollouts, 3 decision times
    returns = [{t: float(g[k, t]) for t in range(3)} for k in range(5)]
    got = np.array([[b[t] for t in range(3)] for b in leave_one_out(returns)])
    want = np.stack([np.delete(g, k, axis=0).mean(axis=0) for k in range(5)])  # drop rollout k, average the rest
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # the advantages sum to zero and are K / (K - 1) times the deviations from the mean
    np.testing.assert_allclose((g - got).sum(axis=0), 0.0, atol=1e-12)
    np.testing.assert_allclose(g - got, 5 / 4 * (g - g.mean(axis=0)), rtol=1e-10)


def test_leave_one_out_counts_only_rollouts_that_reached_a_time():
    got = leave_one_out([{0: -1.0, 5: -0.5}, {0: -3.0}, {0: -2.0, 5: -0.25}])
    assert got == [{0: -2.5, 5: -0.25}, {0: -1.5}, {0: -2.0, 5: -0.5}]
    assert leave_one_out([{0: -1.0, 9: -0.5}, {0: -3.0}])[0][9] == 0.0  # nothing to compare with
    with pytest.raises(ValueError, match="at least 2 rollouts, got 1"):
        leave_one_out([{0: 1.0}])


def test_the_curriculum_opens_the_budgets_as_the_ramp_passes_them():
    ratios = [0.5, 0.75, 0.875]
    # reach = 0.5 + 0.375 * step / 40: 0.75 at step 26.67, 0.875 at step 40
    assert active_ratios(ratios, 0, 40) == [0.5]
    assert active_ratios(ratios, 26, 40) == [0.5]
    assert active_ratios(ratios, 27, 40) == [0.5, 0.75]
    assert active_ratios(ratios, 39, 40) == [0.5, 0.75]
    assert active_ratios(ratios, 40, 40) == ratios and active_ratios(ratios, 500, 40) == ratios
    assert active_ratios(ratios, 0, 0) == ratios  # no curriculum


def test_first_draw_kl_is_the_softmax_kl_over_the_free_entries():
    rng = np.random.default_rng(1)
    ref, cur = rng.normal(size=(2, 3, 7)), rng.normal(size=(2, 3, 7))
    protected = np.zeros(7, dtype=bool)
    protected[[0, 4]] = True

    def softmax(x):
        e = np.exp(x[..., ~protected] - x[..., ~protected].max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    p, q = softmax(ref), softmax(cur)
    want = (p * np.log(p / q)).sum(axis=-1).mean()
    got = first_draw_kl(torch.tensor(ref), torch.tensor(cur), torch.tensor(protected))
    assert float(got) == pytest.approx(want, rel=1e-6)
    # a common shift changes no draw and costs nothing; equal logits give exactly zero
    assert float(first_draw_kl(torch.tensor(ref), torch.tensor(ref + 3.0), torch.tensor(protected))) == \
        pytest.approx(0.0, abs=1e-7)
    assert float(first_draw_kl(torch.tensor(ref), torch.tensor(ref), torch.tensor(protected))) == 0.0


def test_the_stopping_rule_keeps_the_best_step_and_stops_after_patience_evaluations():
    history = [(0, 0.30), (10, 0.25), (20, 0.26), (30, 0.249), (40, 0.27), (50, 0.28)]
    assert StoppingRule(patience=3).verdict(history[:4]).best_step == 30  # any improvement counts
    strict = StoppingRule(patience=3, min_delta=0.005)
    v = strict.verdict(history[:4])
    assert (v.best_step, v.since_best, v.stop) == (10, 2, False)  # 0.249 beats 0.25 by less than 0.005
    v = strict.verdict(history[:5])
    assert (v.best_step, v.best_kl, v.since_best, v.stop) == (10, 0.25, 3, True)
    assert not StoppingRule(patience=0).verdict(history).stop  # 0: never stops early
    assert StoppingRule(patience=2).verdict([(0, 0.1), (10, 0.2), (20, 0.3)]).best_step == 0  # the warm start
    with pytest.raises(ValueError, match="patience must be an int >= 0, got -1"):
        StoppingRule(patience=-1)


def test_patience_counts_only_evaluations_from_patience_from_on():
    # a curriculum transient (issue 51, seed 5200): the KL rises while the small budgets open, then falls
    history = [(0, 0.078), (10, 0.080), (20, 0.083), (30, 0.086), (40, 0.090), (50, 0.085), (60, 0.079),
               (70, 0.079), (80, 0.070)]
    v = StoppingRule(patience=5).verdict(history[:6])
    assert (v.best_step, v.since_best, v.stop) == (0, 5, True)  # counted from step 10: stops at step 50
    late = StoppingRule(patience=5, patience_from=60)
    v = late.verdict(history[:6])
    assert (v.best_step, v.since_best, v.stop) == (0, 0, False)  # steps 10-50 are not counted
    v = late.verdict(history[:8])
    assert (v.best_step, v.since_best, v.stop) == (0, 2, False)  # steps 60 and 70 are
    v = late.verdict(history)
    assert (v.best_step, v.best_kl, v.since_best, v.stop) == (80, 0.070, 0, False)
    # an evaluation before patience_from may still be the best
    assert StoppingRule(patience=1, patience_from=50).verdict([(0, 0.3), (10, 0.2), (20, 0.25)]).best_step == 10
    with pytest.raises(ValueError, match="patience_from must be an int >= 0, got -5"):
        StoppingRule(patience=1, patience_from=-5)


def test_mean_by_step_and_the_paired_interval():
    rows = [{"step": s, "episode": e, "ratio": r, "kl": kl}
            for s, e, r, kl in [(0, "a", 0.5, 0.1), (0, "a", 0.75, 0.3), (0, "b", 0.5, 0.2), (10, "a", 0.5, 0.05),
                                (10, "b", 0.5, 0.15), (10, "a", 0.75, 0.2)]]
    assert mean_by_step(rows, 0.5) == [(0, pytest.approx(0.15)), (10, pytest.approx(0.1))]
    assert mean_by_step(rows) == [(0, pytest.approx(0.2)), (10, pytest.approx(0.4 / 3))]
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=30), rng.normal(size=30) + 0.5
    mean, low, high = paired_interval(list(a), list(b))
    assert mean == pytest.approx(float((a - b).mean()))
    assert low < mean < high < 0  # a shift of 0.5 with unit noise over 30 pairs is resolved
    assert paired_interval([1.0, 2.0], [0.5, 1.5])[1:] == (0.5, 0.5)  # a constant difference has no spread


def test_the_training_curve_prints_plain_tick_labels():
    """An entropy near 1 was labelled "1e-5+9.999e-1" (an axis offset; issue 70): the labels are plain numbers."""
    rows = [{"step": i, "reward": -0.5 + 1e-6 * i, "entropy": 0.99999 + 1e-7 * i} for i in range(20)]
    fig = curve_figure(rows)
    fig.canvas.draw()
    offsets = [ax.yaxis.get_offset_text().get_text() for ax in fig.axes]
    plt.close(fig)
    assert offsets == ["", ""]
