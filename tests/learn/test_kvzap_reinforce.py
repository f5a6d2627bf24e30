"""REINFORCE on top of the KVzip surrogate (kvsieve.learn.kvzap_rollout, network="kvzap" in kvsieve.learn.reinforce)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import episode, random_kvzap, tiny_model, whole_and_resumed

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.learn import reinforce as reinforce_module
from kvsieve.learn.kvzap_rollout import KVzapRolloutPolicy, kvzap_decision_logits
from kvsieve.learn.rollout import Episode, decision_terms
from kvsieve.learn.sampling import gumbel_noise
from kvsieve.learn.train_config import TrainConfig
from kvsieve.networks.kvzap_net import SIGNAL_FEATURES, load_kvzap, save_kvzap, with_signals
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
    for layer, (inputs, signals) in decision.features:
        assert signals is None  # the surrogate alone reads no signals
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
    whole, split = whole_and_resumed(*setup, tmp_path, lr=1e-2)
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
        model(input_ids=_episode(0).context, use_cache=True)


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


def _signal_net(path, weight_seed: int | None = None):
    """The surrogate at ``path`` reading every signal; zero signal weights, or random ones from ``weight_seed``."""
    net, meta = load_kvzap(path)
    wide = with_signals(net)
    if weight_seed is not None:
        with torch.no_grad():
            wide.signal_weight.copy_(torch.randn(wide.signal_weight.shape,
                                                 generator=torch.Generator().manual_seed(weight_seed)))
    return wide, dict(meta, window=8)


def test_a_surrogate_given_signals_keeps_exactly_what_it_kept_until_their_weights_move(setup, tmp_path):
    """with_signals: zero weights on the signals, so step 0 of a signals run is the surrogate, index for index;
    with weights on them, the kept entries follow the window's attention and change."""
    model, path = setup
    ids = _episode(4).context
    kept = {}
    for name, weight_seed in (("zero", None), ("moved", 0)):
        wide, meta = _signal_net(path, weight_seed)
        meta = {k: v for k, v in meta.items() if k not in ("format", "net", "sha256")}
        save_kvzap(tmp_path / f"{name}.safetensors", wide, meta)
    for name, policy in (("surrogate", KVzap(checkpoint=str(path))),
                         ("zero", KVzap(checkpoint=str(tmp_path / "zero.safetensors"))),
                         ("greedy", KVzapRolloutPolicy(*_signal_net(path), 0.25, None, record=False)),
                         ("moved", KVzap(checkpoint=str(tmp_path / "moved.safetensors")))):
        with kvsieve.attach(model, policy, ratio=0.5):
            kept[name] = _kept_sets(model(input_ids=ids, use_cache=True).cache)
    assert kept["zero"] == kept["surrogate"] and kept["greedy"] == kept["surrogate"]
    assert kept["moved"] != kept["surrogate"]
    policy = KVzap(checkpoint=str(tmp_path / "zero.safetensors"))
    assert policy.window == 8 and policy.uses_window and not policy.intrinsic_scores
    assert KVzap(checkpoint=str(path)).intrinsic_scores  # the surrogate alone is unchanged


def test_the_signal_term_is_each_heads_own_features_through_its_own_weights(setup):
    """The decision's logits with signals, written out in numpy: the surrogate's linear map on the standardised
    inputs plus, for head h, sum_s f[h, n, s] W[layer, s, h], over the features recorded for the draw."""
    model, path = setup
    net, meta = _signal_net(path, weight_seed=1)
    temperature = 0.5
    policy = KVzapRolloutPolicy(net, meta, temperature, torch.Generator().manual_seed(5))
    ids = _episode(2).context
    with kvsieve.attach(model, policy, ratio=0.75):
        model(input_ids=ids, use_cache=True)
    (decision,) = policy.decisions
    state = {k: v.double().numpy() for k, v in net.state_dict().items()}
    want = []
    for layer, (inputs, signals) in decision.features:
        assert signals.shape == (1, HEADS, ids.shape[1], len(SIGNAL_FEATURES))
        z = (inputs[0].double().numpy() - state["mean"][layer]) / state["std"][layer]
        surrogate = z @ state["linear_weight"][layer] + state["linear_bias"][layer]  # (n, H)
        f = signals[0].double().numpy()  # (H, n, S)
        term = np.stack([f[h] @ state["signal_weight"][layer][:, h] for h in range(HEADS)], axis=1)  # (n, H)
        want.append(((surrogate + term).T / temperature).reshape(-1))
    got = kvzap_decision_logits(net, decision, "linear", temperature)[0].detach().double().numpy()
    np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-5, atol=1e-5)


def test_the_signals_are_distillcaches_features_of_the_policys_window(setup):
    """What the policy feeds the network, checked in numpy from the layer's own queries and keys: column 0 is
    log1p(n x the attention an entry receives, averaged over the window's queries and the head's query group), the
    window the checkpoint's (8 queries), causal inside it; column 7 the position over the last position."""
    model, path = setup
    net, meta = _signal_net(path)
    policy = KVzap.from_network(net, meta)
    seen = []
    real = policy.signal_inputs
    policy.signal_inputs = lambda signals: seen.append((signals, real(signals))) or seen[-1][1]
    with kvsieve.attach(model, policy, ratio=0.5):
        model(input_ids=_episode(3).context, use_cache=True)
    assert len(seen) == LAYERS
    for signals, features in seen:
        q = signals.window_queries[0].detach().double().numpy() * signals.scaling  # (hq, w, d)
        k = signals.keys[0].detach().double().numpy()  # (h, n, d)
        hq, w, _ = q.shape
        n, group = k.shape[1], hq // HEADS
        assert w == 8 and features.shape == (1, HEADS, n, len(SIGNAL_FEATURES))
        for h in range(HEADS):
            logits = np.einsum("qwd,nd->qwn", q[h * group:(h + 1) * group], k[h])
            for i in range(w):  # window query i sits at position n - w + i and sees nothing after it
                logits[:, i, n - w + i + 1:] = -np.inf
            attention = np.exp(logits - logits.max(-1, keepdims=True))
            attention /= attention.sum(-1, keepdims=True)
            np.testing.assert_allclose(features[0, h, :, 0].numpy(), np.log1p(n * attention.mean(axis=(0, 1))),
                                       rtol=1e-4, atol=1e-5)
        positions = signals.positions[0].double().numpy()
        np.testing.assert_allclose(features[0, :, :, 7].numpy(), positions / positions.max(), rtol=1e-6)


def test_reinforce_with_signals_moves_their_weights_and_resumes_exactly(setup, tmp_path):
    _, path = setup
    whole, split = whole_and_resumed(*setup, tmp_path, lr=1e-3, signals=True, signal_lr=1e-2)
    a, meta = load_kvzap(whole.policy)
    b, _ = load_kvzap(split.policy)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # Adam moves every weight by about its learning rate a step: the signals' map by ~1e-2, the surrogate by ~1e-3
    moved = a.signal_weight.detach().abs().amax()
    assert 3e-3 < float(moved) < 0.05
    start, _ = load_kvzap(path)
    assert float((a.linear_weight - start.linear_weight).abs().amax()) < 0.01
    assert meta["window"] == 8 and meta["signal_features"] == list(SIGNAL_FEATURES)
    policy = KVzap(checkpoint=str(tmp_path / "whole"), model="tiny-llama")
    assert policy.signals == len(SIGNAL_FEATURES) and policy.window == 8


def test_signal_settings_give_clear_errors(setup):
    with pytest.raises(ValueError, match="signals apply to network 'kvzap' with trainable 'all', not network "
                                         "'keepnet'"):
        TrainConfig(signals=True)
    with pytest.raises(ValueError, match="signal_lr must be a number in \\(0, 1\\] with signals = true, got 0.1 "
                                         "\\(signals False\\)"):
        TrainConfig(network="kvzap", mode="prefill", signal_lr=0.1)
    net, _ = load_kvzap(setup[1])
    with pytest.raises(ValueError, match="reads 0 signals per head"):
        net(torch.zeros(1, 4, net.config.input_dim), 0, "linear", torch.zeros(1, HEADS, 4, 10))
    with pytest.raises(ValueError, match="reads 10 signals per head"):
        with_signals(net)(torch.zeros(1, 4, net.config.input_dim), 0, "linear")
