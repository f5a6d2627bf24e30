"""REINFORCE on top of the KVzip surrogate (kvsieve.learn.kvzap_rollout, network="kvzap" in kvsieve.learn.reinforce)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import episode, random_kvzap, tiny_model

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.learn import reinforce as reinforce_module
from kvsieve.learn.kvzap_rollout import KVzapRolloutPolicy, kvzap_decision_logits
from kvsieve.learn.rollout import Episode, decision_terms
from kvsieve.learn.sampling import gumbel_noise
from kvsieve.learn.train import train
from kvsieve.learn.train_config import TrainConfig
from kvsieve.networks.kvzap_net import load_kvzap
from kvsieve.networks.model_shape import ModelShape
from kvsieve.policies.kvzap import KVzap

HEADER = 3
LAYERS, HEADS, HEAD_DIM = 3, 2, 16


def _episode(seed: int, n: int = 80, m: int = 12) -> Episode:
    return episode(seed, n, m)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model("llama")
    path = random_kvzap(model, tmp_path_factory.mktemp("kvzap") / "kvzap.safetensors")
    return model, path


def _kept_sets(cache) -> list[list[set[int]]]:
    out = []
    for _, layer in sieve_layers(cache):
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        out.append([set(layer.positions[0, h][valid[0, h]].tolist()) for h in range(layer.positions.shape[1])])
    return out


def test_a_rollout_is_one_global_plackett_luce_draw_with_the_exact_log_probability(setup):
    model, path = setup
    net, meta = load_kvzap(path)
    temperature = 0.5
    policy = KVzapRolloutPolicy(net, meta, temperature, torch.Generator().manual_seed(3))
    ids = _episode(0).context
    n, ratio = ids.shape[1], 0.75
    with kvsieve.attach(model, policy, ratio=ratio):
        cache = model(input_ids=ids, use_cache=True).cache
    (decision,) = policy.decisions
    kept = round(n * (1 - ratio))
    assert decision.order.shape == (1, LAYERS * HEADS * (kept - HEADER))  # the global budget minus the headers
    # the entries kept are exactly the headers plus the drawn ones, decoded from the flat (layer, head, n) order
    drawn = [[set(range(HEADER)) for _ in range(HEADS)] for _ in range(LAYERS)]
    for flat in decision.order[0].tolist():
        layer, rest = divmod(flat, HEADS * n)
        head, position = divmod(rest, n)
        drawn[layer][head].add(position)
    assert _kept_sets(cache) == drawn
    assert len({len(h) for layer in drawn for h in layer}) > 1  # a real global draw leaves heads ragged
    # the log-probability, written out in numpy: logits = the linear map on standardised inputs / temperature,
    # then prod_i exp(l[o_i]) / sum over the entries not yet drawn
    state = {k: v.double().numpy() for k, v in net.state_dict().items()}
    logits = []
    for layer, inputs in decision.features:
        z = (inputs[0].double().numpy() - state["mean"][layer]) / state["std"][layer]
        logits.append(((z @ state["linear_weight"][layer] + state["linear_bias"][layer]).T / temperature).reshape(-1))
    logits = np.concatenate(logits)
    free = np.ones(logits.shape, dtype=bool)
    free[decision.protected.numpy()] = False
    want = 0.0
    for i in decision.order[0].tolist():
        want += logits[i] - np.log(np.exp(logits[free]).sum())
        free[i] = False
    # Gumbel-top-k: the draws are the free entries in decreasing order of logit + noise (the policy's seeded noise,
    # one (1, heads, n) tensor per layer in layer order, regenerated here)
    g = torch.Generator().manual_seed(3)
    noise = np.concatenate([gumbel_noise((1, HEADS, n), g).double().numpy().reshape(-1) for _ in range(LAYERS)])
    perturbed = np.where(decision.protected.numpy(), -np.inf, logits + noise)
    order = decision.order[0].numpy()
    np.testing.assert_array_equal(order, np.argsort(-perturbed, kind="stable")[:len(order)])
    log_probs, entropy, draws = decision_terms(
        net, [decision], lambda net, d: kvzap_decision_logits(net, d, "linear", temperature))
    assert draws == decision.order.numel()
    got = float(log_probs[decision.time].detach())
    assert math.isclose(got, want, rel_tol=1e-5), (got, want)
    assert log_probs[decision.time].requires_grad and 0 < float(entropy) < 1


def _trainer(model, path, temperature: float = 0.5, **kwargs):
    config = TrainConfig(model="tiny-llama", network="kvzap", init=str(path), mode="prefill", temperature=temperature,
                         ratios=[0.75], window=8, **kwargs)
    return reinforce_module.Trainer(config, model, ModelShape.of(model, "tiny-llama"), [_episode(i) for i in range(2)])


def test_the_greedy_rollout_keeps_what_the_surrogate_policy_keeps(setup):
    model, path = setup
    net, meta = load_kvzap(path)
    ids = _episode(1).context
    kept = {}
    for name, policy in (("greedy", KVzapRolloutPolicy(net, meta, 0.25, None, record=False)),
                         ("policy", KVzap(checkpoint=str(path)))):
        with kvsieve.attach(model, policy, ratio=0.5):
            kept[name] = _kept_sets(model(input_ids=ids, use_cache=True).cache)
    assert kept["greedy"] == kept["policy"]


def test_a_step_moves_the_surrogate_along_the_advantage(setup, tmp_path, monkeypatch):
    """Mean baseline (zero before the first step), no entropy bonus: the advantage is minus a KL, so the step must
    make the drawn (penalised) keep set less likely, and leave the surrogate's mean/std buffers alone."""
    model, path = setup
    trainer = _trainer(model, path, baseline="mean", entropy_coef=0.0, rollouts=1, lr=1e-2, steps=1, out=str(tmp_path))
    seen = []
    real = reinforce_module.reinforce_loss
    monkeypatch.setattr(reinforce_module, "reinforce_loss", lambda *a, **k: seen.append(a) or real(*a, **k))
    before = copy.deepcopy(trainer.net)
    trainer.run_step()
    (_, decisions, returns, _, _, logits_of), = seen
    assert all(r < 0 for r in returns.values())
    old, new = (decision_terms(net, decisions, logits_of)[0] for net in (before, trainer.net))
    assert sum(-returns[t] * float(new[t]) for t in returns) < sum(-returns[t] * float(old[t]) for t in returns)
    assert not torch.equal(before.linear_weight, trainer.net.linear_weight)
    assert torch.equal(before.mean, trainer.net.mean) and torch.equal(before.std, trainer.net.std)


def test_training_writes_a_kvzap_checkpoint_and_resumes_exactly(setup, tmp_path):
    model, path = setup
    common = dict(model="tiny-llama", network="kvzap", init=str(path), mode="prefill", temperature=0.5,
                  ratios=[0.75, 0.5], window=8, rollouts=2, lr=1e-2, save_every=1)
    episodes = [_episode(i) for i in range(3)]
    whole = train(TrainConfig(steps=3, out=str(tmp_path / "whole"), **common), model=model, episodes=episodes,
                  progress=False)
    train(TrainConfig(steps=1, out=str(tmp_path / "split"), **common), model=model, episodes=episodes, progress=False)
    split = train(TrainConfig(steps=3, out=str(tmp_path / "split"), **common), model=model, episodes=episodes,
                  progress=False)
    a, meta = load_kvzap(whole.policy)
    b, _ = load_kvzap(split.policy)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [r["reward"] for r in whole.history] == [r["reward"] for r in split.history]
    start, _ = load_kvzap(path)
    assert not torch.equal(a.linear_weight, start.linear_weight)
    assert meta["reinforce"]["step"] == 3 and meta["header"] == HEADER and meta["variant"] == "linear"
    _, start_meta = load_kvzap(path)  # the surrogate's held-out losses describe it, not the fine-tuned weights
    assert "train" not in meta and meta["init_train"] == start_meta.get("train")
    policy = KVzap(checkpoint=str(tmp_path / "whole"), model="tiny-llama")  # the run folder loads as a surrogate
    with kvsieve.attach(model, policy, ratio=0.5):
        model(input_ids=episodes[0].context, use_cache=True)


def test_bad_settings_give_clear_errors(setup, tmp_path):
    model, path = setup
    with pytest.raises(ValueError, match="network 'kvzap' trains in prefill mode only, not 'decode'"):
        TrainConfig(network="kvzap", mode="decode")
    with pytest.raises(ValueError, match="network 'nope' is not one of keepnet, kvzap"):
        TrainConfig(network="nope")
    with pytest.raises(ValueError, match="temperature must be a number > 0, got 0"):
        TrainConfig(temperature=0)
    with pytest.raises(ValueError, match="fine-tuned by objective 'reinforce', not 'imitate'"):
        TrainConfig(network="kvzap", objective="imitate", mode="prefill")
    other = tiny_model("qwen2")  # same geometry, another config
    with pytest.raises(ValueError, match="was trained for 3 layers.*another config"):
        reinforce_module.Trainer(TrainConfig(model="tiny-qwen", network="kvzap", init=str(path), mode="prefill"),
                                 other, ModelShape.of(other, "tiny-qwen"), [_episode(0)])
