"""The learned policies' research scripts (benchmarks/learn/, on the path by pyproject's pytest ``pythonpath``): the
comparison table pairs each checkpoint with the warm start (numpy), and the variance ablation measures every baseline
on the same rollouts (numpy cosines and noise-to-signal)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import episode, random_kvzap, tiny_model
from learn.compare import table
from learn.variance import BASELINE_NAMES, gradient_estimates, noise_summary

from kvsieve.learn import reinforce as reinforce_module
from kvsieve.learn.train_config import TrainConfig
from kvsieve.networks.model_shape import ModelShape

COMMON = dict(model="tiny-llama", network="kvzap", mode="prefill", temperature=0.5, window=8, lr=1e-2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model("llama")
    return model, random_kvzap(model, tmp_path_factory.mktemp("kvzap") / "kvzap.safetensors")


def test_the_comparison_table_pairs_each_policy_and_their_mean_with_the_first():
    kl = {"warm": [0.10, 0.20, 0.30, 0.40], "a": [0.08, 0.17, 0.28, 0.35], "b": [0.10, 0.18, 0.26, 0.37]}
    rows = [{"episode": f"e{i}", "policy": p, "ratio": 0.75, "kl": v} for p, vs in kl.items() for i, v in enumerate(vs)]
    text = table(rows, ["warm", "a", "b"], [0.75])
    assert "| warm | 0.2500 |" in text and "| a | 0.2200 |" in text
    a_minus = np.mean(np.array(kl["a"]) - np.array(kl["warm"]))  # -0.03, every request lower: interval below 0
    assert f"| a - first | {a_minus:+.4f} [" in text and "(n.d.)" not in text.split("| a - first")[1].split("\n")[0]
    mean_minus = np.mean((np.array(kl["a"]) + np.array(kl["b"])) / 2 - np.array(kl["warm"]))
    assert f"| mean of the others - first | {mean_minus:+.4f} [" in text


def test_the_variance_ablation_measures_each_baseline_on_the_same_rollouts(setup):
    model, path = setup
    config = TrainConfig(init=str(path), ratios=[0.5, 0.75], rollouts=3, out="unused", **COMMON)
    trainer = reinforce_module.Trainer(config, model, ModelShape.of(model, "tiny-llama"), [episode(0, 80, 12)])
    out = gradient_estimates(trainer, 0, repeats=3)
    assert set(out) == set(BASELINE_NAMES) and all(len(v) == 3 for v in out.values())
    assert not torch.equal(out["loo"][0], out["none"][0]) and not torch.equal(out["loo"][0], out["greedy"][0])
    # noise_summary against numpy: pairwise cosines and the mean squared deviation over the squared mean
    g = np.random.default_rng(3).normal(size=(4, 6)) + 1.0
    cos, nsr = noise_summary([torch.tensor(row) for row in g])
    pairs = [(i, j) for i in range(4) for j in range(i + 1, 4)]
    want_cos = np.mean([g[i] @ g[j] / np.linalg.norm(g[i]) / np.linalg.norm(g[j]) for i, j in pairs])
    mean = g.mean(axis=0)
    assert cos == pytest.approx(want_cos, rel=1e-9)
    assert nsr == pytest.approx(((g - mean) ** 2).sum(axis=1).mean() / (mean ** 2).sum(), rel=1e-9)
