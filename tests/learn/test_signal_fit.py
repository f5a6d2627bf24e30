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
    """{("s", layer): the surrogate's scores, ("f", layer): the signals it reads}, from the kvzap policy itself."""
    policy = KVzap.from_network(with_signals(net), meta)  # zero signal weights: the surrogate's own scores
    seen = {}
    real_inputs, real_score = policy.signal_inputs, policy.score
    policy.signal_inputs = lambda s: seen.setdefault(("f", s.layer_idx), real_inputs(s))
    policy.score = lambda s: seen.setdefault(("s", s.layer_idx), real_score(s))
    with kvsieve.attach(model, policy, ratio=0.5):
        model(input_ids=ids, use_cache=True)
    return seen


def test_the_fit_is_the_ridge_solution_on_each_heads_signals(setup):
    """The fitted map written out in numpy: per layer and head, X = the head's signals (header rows dropped),
    y = log(exp(s) + a) - s with s the surrogate's score and a the eager model's continuation attention, and
    w = (X'X / N + ridge I)^-1 X'y / N over the rows of every episode."""
    model, eager, path = setup
    net, meta = load_kvzap(path)
    meta = dict(meta, window=WINDOW)
    episodes = [episode(i, 60 + 10 * i, 8 + i) for i in range(2)]
    ridge = 0.05
    fitted = with_signals(net)
    fit_signal_map(fitted, meta, model, episodes, ridge)
    layers = net.config.num_layers
    xs = [[[] for _ in range(HEADS)] for _ in range(layers)]
    ys = [[[] for _ in range(HEADS)] for _ in range(layers)]
    for ep in episodes:
        seen = _scores_and_signals(model, net, meta, ep.context)
        future = _eager_continuation_attention(eager, ep)
        for layer in range(layers):
            f = seen[("f", layer)][0].double().numpy()  # (h, n, S)
            s = seen[("s", layer)][0].double().numpy()  # (h, n)
            for h in range(HEADS):
                xs[layer][h].append(f[h, HEADER:])
                ys[layer][h].append((np.log(np.exp(s[h]) + future[layer][h]) - s[h])[HEADER:])
    got = fitted.signal_weight.detach().double().numpy()  # (L, S, H)
    for layer in range(layers):
        for h in range(HEADS):
            x, y = np.concatenate(xs[layer][h]), np.concatenate(ys[layer][h])
            want = np.linalg.solve(x.T @ x / len(y) + ridge * np.eye(x.shape[1]), x.T @ y / len(y))
            np.testing.assert_allclose(got[layer, :, h], want, rtol=1e-3, atol=1e-4)
    assert torch.equal(fitted.linear_weight, net.linear_weight)  # the surrogate itself is untouched
    assert float(np.abs(got).max()) > 1e-2


def test_training_starts_from_the_fit_and_resumes_exactly(setup, tmp_path):
    """signal_fit: step 0 is the fitted map; the trust region pulls towards it, so a resume that forgot it (and
    pulled towards zero weights) would end elsewhere."""
    model, _, path = setup
    whole, split = whole_and_resumed(model, path, tmp_path, lr=1e-3, signals=True, signal_lr=1e-2, signal_fit=True,
                                     trust_coef=1.0)
    runs = {"whole": whole, "split": split}
    a, meta = load_kvzap(runs["whole"].policy)
    b, _ = load_kvzap(runs["split"].policy)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [r["reward"] for r in runs["whole"].history] == [r["reward"] for r in runs["split"].history]
    start, _ = load_kvzap(path)
    alone = with_signals(start)
    fit_signal_map(alone, dict(meta, window=WINDOW), model, [episode(i, 80, 12) for i in range(3)], 0.01)
    # three Adam steps move each weight by at most ~3 x signal_lr from the fit
    assert float((a.signal_weight - alone.signal_weight).detach().abs().amax()) < 0.05
    assert float(alone.signal_weight.detach().abs().amax()) > 0.05
    assert (tmp_path / "whole" / "signal_fit.json").is_file()


def test_fit_settings_give_clear_errors(setup):
    with pytest.raises(ValueError, match="true only with signals = true; got signal_fit True \\(signals False\\)"):
        TrainConfig(network="kvzap", mode="prefill", signal_fit=True)
    with pytest.raises(ValueError, match="signal_ridge must be a number > 0, got 0"):
        TrainConfig(network="kvzap", mode="prefill", signals=True, signal_ridge=0)
    model, _, path = setup
    net, meta = load_kvzap(path)
    with pytest.raises(ValueError, match="needs a kvzap network that reads signals"):
        fit_signal_map(net, meta, model, [episode(0, 40, 5)], 0.1)
    with pytest.raises(ValueError, match="ridge must be a number > 0, got -1"):
        fit_signal_map(with_signals(net), dict(meta, window=WINDOW), model, [episode(0, 40, 5)], -1)
