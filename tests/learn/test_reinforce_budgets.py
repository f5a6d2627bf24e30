"""Issue 51's REINFORCE step on the KVzip surrogate: every budget of a request in one update with leave-one-out
baselines, the curriculum, the trust region, held-out evaluations with the stopping rule, an exact resume, and
the warm start (step 0) keeping exactly what the shipped surrogate keeps on SmolLM2."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from conftest import episode, random_kvzap, tiny_model

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.learn import reinforce as reinforce_module
from kvsieve.learn.rollout import context_cache_for, rollout, teacher_for
from kvsieve.learn.train import train
from kvsieve.learn.train_config import TrainConfig, episodes_from_samples
from kvsieve.networks.kvzap_net import load_kvzap
from kvsieve.networks.model_shape import ModelShape
from kvsieve.policies.kvzap import KVzap
from kvsieve.selection import Budget
from kvsieve.tasks.load import SampleSpec, load_samples


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model("llama")
    return model, random_kvzap(model, tmp_path_factory.mktemp("kvzap") / "kvzap.safetensors")


COMMON = dict(model="tiny-llama", network="kvzap", mode="prefill", temperature=0.5, window=8, lr=1e-2)


def _kept_sets(cache) -> list[list[set[int]]]:
    out = []
    for _, layer in sieve_layers(cache):
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        out.append([set(layer.positions[0, h][valid[0, h]].tolist()) for h in range(layer.positions.shape[1])])
    return out


def test_one_step_scores_every_budget_with_leave_one_out_baselines(setup, monkeypatch):
    model, path = setup
    config = TrainConfig(init=str(path), ratios=[0.5, 0.75], all_ratios=True, rollouts=3, baseline="loo",
                         entropy_coef=0.0, steps=1, out="unused", **COMMON)
    trainer = reinforce_module.Trainer(config, model, ModelShape.of(model, "tiny-llama"), [episode(0, 80, 12)])
    seen, real = [], reinforce_module.reinforce_loss
    monkeypatch.setattr(reinforce_module, "reinforce_loss",
                        lambda *a, **k: seen.append((a, real(*a, **k))) or seen[-1][1])
    row = trainer.run_step()
    assert len(seen) == 6 and row["active_ratios"] == 2  # 3 rollouts at each of the 2 budgets
    draws = [int(args[1][0].order.numel()) for args, _ in seen]
    assert draws[:3] == [draws[0]] * 3 and draws[3:] == [draws[3]] * 3 and draws[0] > draws[3]  # 50% then 25% kept
    for group in (seen[:3], seen[3:]):  # the baseline of rollout k: numpy mean of the other two rollouts' returns
        g = np.array([args[2][t] for args, _ in group for t in args[2]])
        want = np.array([np.delete(g, k).mean() for k in range(3)])
        got = np.array([args[3][t] for args, _ in group for t in args[3]])
        np.testing.assert_allclose(got, want, rtol=1e-12)
    losses = [float(loss.detach()) for _, (loss, _) in seen]
    want = (np.mean(losses[:3]) + np.mean(losses[3:])) / 2  # float32 sums of terms that nearly cancel
    assert row["loss"] == pytest.approx(want, abs=1e-5 * max(map(abs, losses)))


def test_the_curriculum_and_the_trust_region_in_a_run(setup, tmp_path):
    model, path = setup
    config = TrainConfig(init=str(path), ratios=[0.5, 0.75], all_ratios=True, curriculum_steps=2, rollouts=2,
                         baseline="loo", trust_coef=0.5, steps=3, save_every=1, out=str(tmp_path), **COMMON)
    result = train(config, model=model, episodes=[episode(i, 80, 12) for i in range(2)], progress=False)
    assert [r["active_ratios"] for r in result.history] == [1, 1, 2]  # 0.75 opens at step 2 of 2
    trust = [r["trust_kl"] for r in result.history]
    assert trust[0] == 0.0 and trust[1] > 0 and trust[2] > 0  # zero at the warm start, then the policy has moved


def _run(model, path, out, steps, **kw):
    config = TrainConfig(init=str(path), ratios=[0.5, 0.75], all_ratios=True, curriculum_steps=2, rollouts=2,
                         baseline="loo", trust_coef=0.1, save_every=1, eval_every=2, steps=steps, out=str(out),
                         **COMMON, **kw)
    return train(config, model=model, episodes=[episode(i, 80, 12) for i in range(3)], progress=False,
                 heldout=[episode(100 + i, 80, 12) for i in range(2)])


def _rows(path):
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_a_killed_run_resumes_to_the_same_weights_evaluations_and_kept_policy(setup, tmp_path):
    model, path = setup
    whole = _run(model, path, tmp_path / "whole", 6)
    _run(model, path, tmp_path / "split", 1)  # "killed" after step 1 ...
    _run(model, path, tmp_path / "split", 3)  # ... and after step 3 (between two evaluations)
    split = _run(model, path, tmp_path / "split", 6)
    a = reinforce_module.load_checkpoint(whole.checkpoint)
    b = reinforce_module.load_checkpoint(split.checkpoint)
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)  # weights, Adam's state
    assert [r["reward"] for r in whole.history] == [r["reward"] for r in split.history]
    held = _rows(tmp_path / "whole" / "heldout.csv")
    assert held == _rows(tmp_path / "split" / "heldout.csv")
    assert sorted({int(r["step"]) for r in held}) == [0, 2, 4, 6] and len(held) == 4 * 2 * 2
    (pa, ma), (pb, mb) = load_kvzap(whole.policy), load_kvzap(split.policy)  # metadata names each run's out, steps
    assert all(torch.equal(x, y) for x, y in zip(pa.state_dict().values(), pb.state_dict().values()))
    assert ma["reinforce"]["step"] == mb["reinforce"]["step"]
    # policy.safetensors is the evaluated step of lowest mean held-out KL
    means = {}
    for r in held:
        means.setdefault(int(r["step"]), []).append(float(r["kl"]))
    best = min(means, key=lambda s: (np.mean(means[s]), s))
    _, meta = load_kvzap(whole.policy)
    assert meta.get("reinforce", {}).get("step", 0) == best


def test_a_run_that_never_improves_stops_and_ships_its_warm_start(setup, tmp_path):
    model, path = setup
    result = _run(model, path, tmp_path, 20, patience=1, min_delta=10.0)  # nothing beats step 0 by 10 nats
    assert result.step == 2  # stopped at the first evaluation after step 0
    start, _ = load_kvzap(path)
    shipped, _ = load_kvzap(result.policy)
    assert all(torch.equal(x, y) for x, y in zip(start.state_dict().values(), shipped.state_dict().values()))
    again = _run(model, path, tmp_path, 20, patience=1, min_delta=10.0)  # a rerun stays stopped
    assert again.step == 2


@pytest.mark.model
@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.875])
def test_step_0_keeps_exactly_what_the_shipped_surrogate_keeps_on_smollm2(smollm2, ratio):
    model, tokenizer = smollm2
    spec = SampleSpec(model="smollm2-135m-instruct", tasks=["niah_single_1"], lengths=[512], samples=1, seed=7000)
    (ep,) = episodes_from_samples(list(load_samples(spec, tokenizer)), tokenizer)
    config = TrainConfig(model="smollm2-135m-instruct", network="kvzap", mode="prefill", temperature=0.25,
                         out="unused")
    trainer = reinforce_module.Trainer(config, model, ModelShape.of(model, config.model), [ep])
    kept = Budget(ratio=ratio).resolve(ep.context.shape[1])
    shipped = KVzap(checkpoint="smollm2-135m-instruct")
    with kvsieve.attach(model, shipped, kept=kept):
        want = _kept_sets(model(input_ids=ep.context, use_cache=True).cache)
    greedy = trainer.rollout_policy(None, record=False)
    with kvsieve.attach(model, greedy, kept=kept):
        got = _kept_sets(model(input_ids=ep.context, use_cache=True).cache)
    assert got == want
    assert sum(len(h) for layer in got for h in layer) == 30 * 3 * kept  # the global budget, spent
    # and the rollout the held-out evaluation runs (pruning a clone of the context's cache) keeps the same
    cache = context_cache_for(model, ep, config.window)
    teacher = teacher_for(model, ep, "prefill", config.window, 1, 256, cache)
    result = rollout(model, ep, trainer.rollout_policy(None, record=False), "prefill", kept, 1, teacher, cache)
    assert result.kl.numel() == ep.continuation.shape[1]


def test_trainable_bias_moves_only_the_output_biases(setup):
    model, path = setup
    config = TrainConfig(init=str(path), ratios=[0.5, 0.75], all_ratios=True, rollouts=2, baseline="loo",
                         trainable="bias", steps=1, out="unused", **COMMON)
    trainer = reinforce_module.Trainer(config, model, ModelShape.of(model, "tiny-llama"), [episode(0, 80, 12)])
    before = {k: v.clone() for k, v in trainer.net.state_dict().items()}
    trainer.run_step()
    moved = {k for k, v in trainer.net.state_dict().items() if not torch.equal(v, before[k])}
    assert moved == {"linear_bias"}
    with pytest.raises(ValueError, match="trainable 'bias' applies to network 'kvzap', not 'keepnet'"):
        TrainConfig(trainable="bias")
