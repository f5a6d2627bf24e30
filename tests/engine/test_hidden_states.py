"""The hidden states entering each attention layer (kvsieve.engine.hidden_states) and the kvzap that reads them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TOKENIZER, header_ids, tiny_model

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.compress import layer_signals
from kvsieve.learn.kvzap_train import KVzapTrainConfig, train_kvzap
from kvsieve.learn.rollout import Episode
from kvsieve.learn.train_config import TrainConfig
from kvsieve.networks.kvzap_net import load_kvzap
from kvsieve.policies import FullCache, get
from kvsieve.policies.kvzap import KVzap


def _ids(seed: int, n: int = 80) -> torch.Tensor:
    return header_ids(seed, n)


def _capture(hidden: bool = True) -> FullCache:
    capture = FullCache(window=1)
    capture.needs_hidden_states = hidden
    return capture


@torch.no_grad()
def _normed_layer_inputs(model, ids) -> list[torch.Tensor]:
    """Independently of the hook: each decoder layer's input (transformers' ``output_hidden_states``, the
    embeddings then every layer's output) through the layer's own ``input_layernorm``."""
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return [layer.input_layernorm(out.hidden_states[i]) for i, layer in enumerate(model.model.layers)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kept_hidden_states_are_each_layers_normed_input_also_across_forwards(arch):
    model = tiny_model(arch)
    ids = _ids(1)
    want = _normed_layer_inputs(model, ids)
    with kvsieve.attach(model, _capture(), ratio=0.0):
        cache = model(input_ids=ids, use_cache=True).cache
    with kvsieve.attach(model, _capture(), ratio=0.0):  # a prompt read in two forwards appends its rows
        split = model(input_ids=ids[:, :50], use_cache=True).cache
        model(input_ids=ids[:, 50:], cache=split, use_cache=True)
    for (idx, layer), (_, second) in zip(sieve_layers(cache), sieve_layers(split)):
        assert layer.hidden_states.shape == (1, ids.shape[1], model.config.hidden_size)
        torch.testing.assert_close(layer.hidden_states, want[idx], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(second.hidden_states, want[idx], atol=1e-5, rtol=1e-5)
        signals = layer_signals(layer, idx, len(cache.layers), 0, 1)
        assert signals.hidden_states is layer.hidden_states
        # and they are what the cached values were projected from
        attention = model.model.layers[idx].self_attn
        values = attention.v_proj(layer.hidden_states).view(1, ids.shape[1], -1, attention.head_dim).transpose(1, 2)
        torch.testing.assert_close(values, layer.values, atol=1e-5, rtol=1e-5)


def test_no_hidden_states_unless_a_policy_asks_and_none_after_a_compression():
    model = tiny_model("llama")
    ids = _ids(2)
    with kvsieve.attach(model, _capture(hidden=False), ratio=0.0):
        cache = model(input_ids=ids, use_cache=True).cache
    assert all(layer.hidden_states is None for _, layer in sieve_layers(cache))
    assert layer_signals(sieve_layers(cache)[0][1], 0, 3, 0, 1).hidden_states is None

    class Recording(FullCache):  # a compressing policy that asks for hidden states and records what it saw
        evicts = True
        needs_hidden_states = True
        seen: list = []

        def score(self, signals):
            self.seen.append(None if signals.hidden_states is None else tuple(signals.hidden_states.shape))
            return signals.keys.float().norm(dim=-1)

    policy = Recording(window=1)
    with kvsieve.attach(model, policy, ratio=0.5):
        cache = model(input_ids=ids, use_cache=True).cache
        assert policy.seen == [(1, ids.shape[1], model.config.hidden_size)] * 3  # every layer, at its compression
        assert all(layer.hidden_states is None for _, layer in sieve_layers(cache))  # freed with the pruned entries
        model(input_ids=ids[:, :4], cache=cache, use_cache=True)  # later tokens do not start a misaligned set
    assert all(layer.hidden_states is None for _, layer in sieve_layers(cache))


@pytest.fixture(scope="module")
def hidden_kvzap(tmp_path_factory):
    model = tiny_model("llama")
    with torch.no_grad():  # peaked attention: KVzip's scores then depend on the inputs (as in test_kvzap)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12.0)
            layer.self_attn.k_proj.weight.mul_(12.0)
    episodes = [("random", Episode(_ids(10 + i), _ids(10 + i)[:, :0], f"r{i}")) for i in range(24)]
    config = KVzapTrainConfig(model="tiny-llama", samples=0, text_docs=24, positions=48, hidden=8, steps=60,
                              lr=1e-2, ridge=10.0, holdout=0.25, inputs="hidden",
                              out=str(tmp_path_factory.mktemp("kvzap-hidden")))
    return model, train_kvzap(config, model, TOKENIZER, progress=False, episodes=episodes), episodes


def test_a_hidden_state_kvzap_trains_on_the_hidden_states_below_a_constant(hidden_kvzap):
    import json

    from safetensors import safe_open

    model, result, episodes = hidden_kvzap
    losses = result.report["losses"]
    assert losses["linear"] < 0.9 * losses["constant"], losses
    net, meta = load_kvzap(result.policy)
    assert meta["inputs"] == "hidden" and net.config.input_dim == model.config.hidden_size
    # the training rows are the layers' normed inputs at the sampled positions (this tiny model's hidden size
    # equals 2 x kv_heads x head_dim, so a row of keys and values would have the same shape)
    names = {e.name: e for _, e in episodes}
    files = sorted((result.out / "kvzap-data").glob("*.safetensors"))
    assert len(files) == len(episodes)
    for path in files[:3]:
        with safe_open(str(path), framework="pt") as handle:
            episode = names[json.loads(handle.metadata()["key"])["name"]]
            rows, picked = handle.get_tensor("inputs"), handle.get_tensor("positions")
        want = torch.stack([h[0, picked] for h in _normed_layer_inputs(model, episode.context)])
        torch.testing.assert_close(rows.float(), want, atol=2e-3, rtol=2e-3)  # stored as float16


def test_a_hidden_state_kvzap_scores_the_hidden_states_and_spends_a_global_budget(hidden_kvzap):
    model, result, _ = hidden_kvzap
    net, _ = load_kvzap(result.policy)
    policy = KVzap(checkpoint=str(result.policy), variant="linear", model="tiny-llama")
    assert policy.needs_hidden_states
    ids = _ids(99)
    layer_inputs = _normed_layer_inputs(model, ids)
    seen = {}
    score = policy.score

    def recording(signals):
        seen[signals.layer_idx] = score(signals)[0].double().numpy()
        return seen[signals.layer_idx]

    policy.score = lambda signals: torch.from_numpy(recording(signals))[None].float()
    with kvsieve.attach(model, policy, ratio=0.5):
        cache = model(input_ids=ids, use_cache=True).cache
    state = {k: v.double().numpy() for k, v in net.state_dict().items()}
    for idx in range(3):  # the linear variant written out in numpy on the independently derived inputs
        x = layer_inputs[idx][0].double().numpy()
        z = (x - state["mean"][idx]) / state["std"][idx]
        np.testing.assert_allclose(seen[idx], (z @ state["linear_weight"][idx] + state["linear_bias"][idx]).T,
                                   atol=1e-4, rtol=1e-4)
    kept = sum(int(layer.valid.sum()) if layer.valid is not None else layer.positions.numel()
               for _, layer in sieve_layers(cache))
    assert kept == 3 * 2 * round(ids.shape[1] * 0.5)  # the global budget, exactly


def test_a_hidden_state_kvzap_refuses_a_cache_without_them(hidden_kvzap):
    model, result, _ = hidden_kvzap
    policy = get("kvzap", checkpoint=str(result.policy))
    with kvsieve.attach(model, _capture(hidden=False), ratio=0.0):
        cache = model(input_ids=_ids(3), use_cache=True).cache
    with pytest.raises(ValueError, match="reads the hidden states entering each layer"):
        policy.score(layer_signals(sieve_layers(cache)[0][1], 0, 3, 0, 1))
    with pytest.raises(ValueError, match="inputs 'residual' is not one of 'kv', 'hidden'"):
        KVzapTrainConfig(inputs="residual")
    with pytest.raises(ValueError, match="kvzap_inputs 'residual'"):
        TrainConfig(kvzap_inputs="residual")


def test_the_grid_keeps_hidden_states_for_a_policy_that_reads_them(hidden_kvzap):
    # the shared-prefill path builds its own capture: it must ask for what the cells' policies read
    from kvsieve.harness.evaluate import evaluate_sample
    from kvsieve.policies.label import Point
    from kvsieve.tasks.ruler import generate

    model, result, _ = hidden_kvzap
    sample = generate("niah_single_1", 300, 0, lambda t: len(t))
    cells = [Point(f"kvzap(checkpoint='{result.policy}')", ratio) for ratio in (0.5, 0.75)]
    shared = evaluate_sample(model, TOKENIZER, sample, cells, shared=True)
    alone = evaluate_sample(model, TOKENIZER, sample, cells, shared=False)  # attach() with the policy itself
    assert [(r.kept_tokens, r.cache_bytes, r.prediction) for r in shared] == \
        [(r.kept_tokens, r.cache_bytes, r.prediction) for r in alone]
    assert shared[0].cache_bytes < shared[0].cache_bytes_full
