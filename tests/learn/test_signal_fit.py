"""The supervised start of the surrogate's signal map (kvsieve.learn.signal_fit, ``signal_fit`` in training)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import episode, random_kvzap, sharpened, tiny_config, whole_and_resumed
from transformers import AutoModelForCausalLM

import kvsieve
from kvsieve.learn.signal_fit import continuation_attention, fit_signal_map
from kvsieve.learn.train_config import TrainConfig
from kvsieve.networks.kvzap_net import load_kvzap, with_signals
from kvsieve.policies.kvzap import KVzap

HEADER, HEADS, WINDOW = 3, 2, 8


def _model(attention: str):
    torch.manual_seed(0)  # the same weights for every implementation
    return sharpened(AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=attention).eval())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = _model("sdpa")
    return model, _model("eager"), random_kvzap(model, tmp_path_factory.mktemp("kvzap") / "kvzap.safetensors")


def _eager_continuation_attention(eager, ep) -> list[np.ndarray]:
    """Per layer (h, n): the model's own attention probabilities (transformers' eager attention), the largest over
    the continuation's rows and each KV head's query heads, on the context's columns."""
    n = ep.context.shape[1]
    with torch.no_grad():
        attentions = eager(input_ids=ep.ids, output_attentions=True).attentions
    out = []
    for a in attentions:  # (1, hq, T, T)
        a = a[0, :, n:, :n].double().numpy()
        group = a.shape[0] // HEADS
        out.append(np.stack([a[h * group:(h + 1) * group].max(axis=(0, 1)) for h in range(HEADS)]))
    return out


def test_the_continuation_attention_is_the_models_own(setup):
    model, eager, _ = setup
    ep = episode(0, 60, 10)
    got = continuation_attention(model, ep)
    want = _eager_continuation_attention(eager, ep)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == (1, HEADS, 60)
        np.testing.assert_allclose(g[0].double().numpy(), w, rtol=1e-4, atol=1e-6)
    assert max(float(w.max()) for w in want) > 0.2  # peaked attention: a wrong row or column would show


def _scores_and_signals(model, net, meta, ids) -> dict:
    """{("s", layer): the policy's scores, ("f", layer): the signals it reads}, from the kvzap policy itself."""
    # a surrogate alone gets zero signal weights: its own scores
    policy = KVzap.from_network(net if net.config.signals else with_signals(net), meta)
    seen = {}
    real_inputs, real_score = policy.signal_inputs, policy.score
    policy.signal_inputs = lambda s: seen.setdefault(("f", s.layer_idx), real_inputs(s))
    policy.score = lambda s: seen.setdefault(("s", s.layer_idx), real_score(s))
    with kvsieve.attach(model, policy, ratio=0.5):
        model(input_ids=ids, use_cache=True)
    return seen


def _rows_in_numpy(model, eager, net, meta, episodes) -> tuple[list, list, list]:
    """Per layer and head, over every episode (header rows dropped): X = the head's signals, s = the surrogate's
    score, a = the eager model's continuation attention."""
    layers = net.config.num_layers
    xs, ss, as_ = ([[[] for _ in range(HEADS)] for _ in range(layers)] for _ in range(3))
    for ep in episodes:
        seen = _scores_and_signals(model, net, meta, ep.context)
        future = _eager_continuation_attention(eager, ep)
        for layer in range(layers):
            f = seen[("f", layer)][0].double().numpy()  # (h, n, S)
            s = seen[("s", layer)][0].double().numpy()  # (h, n)
            for h in range(HEADS):
                xs[layer][h].append(f[h, HEADER:])
                ss[layer][h].append(s[h, HEADER:])
                as_[layer][h].append(future[layer][h, HEADER:])
    join = [[[np.concatenate(v[layer][h]) for h in range(HEADS)] for layer in range(layers)] for v in (xs, ss, as_)]
    return tuple(join)


@pytest.mark.parametrize("continuation_weight, affine", [(1.0, False), (4.0, True)])
def test_the_fit_is_the_ridge_solution_on_each_heads_signals(setup, continuation_weight, affine):
    """The fitted map written out in numpy: per layer and head, X = the head's signals (header rows dropped; with
    ``affine`` also s and 1), y = log(exp(s) + lambda a) - s with s the surrogate's score and a the eager model's
    continuation attention, and w = (X'X / N + ridge I)^-1 X'y / N over the rows of every episode (the constant
    column not shrunk). The fitted policy then scores every entry s + X w."""
    model, eager, path = setup
    net, meta = load_kvzap(path)
    meta = dict(meta, window=WINDOW)
    episodes = [episode(i, 60 + 10 * i, 8 + i) for i in range(2)]
    ridge = 0.05
    fitted = with_signals(net)
    fit = fit_signal_map(fitted, meta, model, episodes, ridge, continuation_weight=continuation_weight,
                         affine=affine)
    assert fit.affine == affine and fit.continuation_weight == continuation_weight
    xs, ss, as_ = _rows_in_numpy(model, eager, net, meta, episodes)
    got = fitted.signal_weight.detach().double().numpy()  # (L, S, H)
    S = got.shape[1]
    probe = episode(5, 70, 8).context  # the fitted scores on a request of neither fit
    before, after = _scores_and_signals(model, net, meta, probe), _scores_and_signals(model, fitted, meta, probe)
    for layer in range(net.config.num_layers):
        for h in range(HEADS):
            x, s, a = xs[layer][h], ss[layer][h], as_[layer][h]
            if affine:
                x = np.concatenate([x, s[:, None], np.ones((len(s), 1))], axis=1)
            y = np.log(np.exp(s) + continuation_weight * a) - s
            penalty = np.full(x.shape[1], ridge)
            if affine:
                penalty[-1] = 0.0
            want = np.linalg.solve(x.T @ x / len(y) + np.diag(penalty), x.T @ y / len(y))
            np.testing.assert_allclose(got[layer, :, h], want[:S], rtol=1e-3, atol=1e-4)
            s_probe = before[("s", layer)][0, h].double().numpy()
            f_probe = before[("f", layer)][0, h].double().numpy()
            columns = np.concatenate([f_probe, s_probe[:, None], np.ones((len(s_probe), 1))], axis=1) \
                if affine else f_probe
            np.testing.assert_allclose(after[("s", layer)][0, h].double().numpy(), s_probe + columns @ want,
                                       rtol=1e-4, atol=1e-3)
            if affine:
                assert abs(want[S]) > 1e-3 and abs(want[S + 1]) > 1e-3  # the scale and shift did something
    assert torch.equal(fitted.linear_weight, net.linear_weight) != affine  # only affine touches the surrogate
    assert float(np.abs(got).max()) > 1e-2


@pytest.mark.parametrize("affine", [False, True])
def test_training_starts_from_the_fit_and_resumes_exactly(setup, tmp_path, affine):
    """signal_fit: step 0 is the fitted start; the trust region pulls towards it, so a resume that forgot it (and
    pulled towards zero weights, or the surrogate before its rescaling) would end elsewhere."""
    model, _, path = setup
    whole, split = whole_and_resumed(model, path, tmp_path, lr=1e-3, signals=True, signal_lr=1e-2, signal_fit=True,
                                     trust_coef=1.0, signal_continuation_weight=2.0, signal_affine=affine)
    runs = {"whole": whole, "split": split}
    a, meta = load_kvzap(runs["whole"].policy)
    b, _ = load_kvzap(runs["split"].policy)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [r["reward"] for r in runs["whole"].history] == [r["reward"] for r in runs["split"].history]
    start, _ = load_kvzap(path)
    alone = with_signals(start)
    fit_signal_map(alone, dict(meta, window=WINDOW), model, [episode(i, 80, 12) for i in range(3)], 0.01,
                   continuation_weight=2.0, affine=affine)
    # three Adam steps move each weight by at most ~3 x signal_lr from the fit
    assert float((a.signal_weight - alone.signal_weight).detach().abs().amax()) < 0.05
    if affine:  # the rescaled surrogate moved with lr 1e-3 from the fitted start, not from the shipped one
        assert float((a.linear_bias - alone.linear_bias).detach().abs().amax()) < 0.01
        assert float((alone.linear_bias - start.linear_bias).detach().abs().amax()) > 0.01
    assert float(alone.signal_weight.detach().abs().amax()) > 0.05
    assert (tmp_path / "whole" / "signal_fit.json").is_file()


def test_fit_settings_give_clear_errors(setup):
    with pytest.raises(ValueError, match="true only with signals = true; got signal_fit True \\(signals False\\)"):
        TrainConfig(network="kvzap", mode="prefill", signal_fit=True)
    with pytest.raises(ValueError, match="signal_ridge must be a number > 0, got 0"):
        TrainConfig(network="kvzap", mode="prefill", signals=True, signal_ridge=0)
    with pytest.raises(ValueError, match="signal_continuation_weight must be a number > 0, and it and signal_affine "
                                         "apply only with signal_fit = true; got 0,"):
        TrainConfig(network="kvzap", mode="prefill", signals=True, signal_fit=True, signal_continuation_weight=0)
    with pytest.raises(ValueError, match="got 1.0, signal_affine True \\(signal_fit False\\)"):
        TrainConfig(network="kvzap", mode="prefill", signals=True, signal_affine=True)
    with pytest.raises(ValueError, match="signal_affine must be true or false, got 'yes'"):
        TrainConfig(network="kvzap", mode="prefill", signals=True, signal_fit=True, signal_affine="yes")
    model, _, path = setup
    net, meta = load_kvzap(path)
    with pytest.raises(ValueError, match="needs a kvzap network that reads signals"):
        fit_signal_map(net, meta, model, [episode(0, 40, 5)], 0.1)
    with pytest.raises(ValueError, match="continuation_weight must be a number > 0, got -2"):
        fit_signal_map(with_signals(net), meta, model, [episode(0, 40, 5)], 0.1, continuation_weight=-2)
    with pytest.raises(ValueError, match="ridge must be a number > 0, got -1"):
        fit_signal_map(with_signals(net), dict(meta, window=WINDOW), model, [episode(0, 40, 5)], -1)
