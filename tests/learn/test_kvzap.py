"""The KVzip surrogate (kvsieve.policies.kvzap, kvzap_train): inputs, targets, training, checkpoints, policy."""

from __future__ import annotations

import copy
import dataclasses
import shutil

import numpy as np
import pytest
import torch
from conftest import HEADER, TOKENIZER, header_ids, random_kvzap, sharpened, tiny_model

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.compress import layer_signals
from kvsieve.engine.reconstruct import ReconstructionPrompt
from kvsieve.evolve.cascade import DevSet
from kvsieve.evolve.seeds import SEEDS
from kvsieve.language.program_features import load_features
from kvsieve.learn.kvzap_train import (
    KVzapTrainConfig,
    collect_rows,
    collect_sequence,
    rope_tables,
    stdlib_texts,
    train_kvzap,
)
from kvsieve.learn.rollout import Episode
from kvsieve.networks import shipped as shipped_module
from kvsieve.networks.kvzap_net import kvzap_inputs, load_kvzap, pre_rope_keys
from kvsieve.policies import FullCache
from kvsieve.policies.kvzap import KVzap, shipped_kvzap_for
from kvsieve.policies.program import ProgramPolicy
from kvsieve.tasks.sample import Sample


def _ids(seed: int, n: int = 90) -> torch.Tensor:
    return header_ids(seed, n)


@torch.no_grad()
def _projections(model, ids):
    """Per layer, the k_proj and v_proj outputs of a plain forward, as (1, h, n, d): the keys before RoPE."""
    seen, hooks = {}, []
    for idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            hooks.append(getattr(attn, name).register_forward_hook(
                lambda m, a, out, idx=idx, name=name, d=attn.head_dim: seen.__setitem__(
                    (idx, name), out.view(*out.shape[:2], -1, d).transpose(1, 2))))
    try:
        with kvsieve.attach(model, FullCache(window=1), ratio=0.0):
            cache = model(input_ids=ids, use_cache=True).cache
    finally:
        for hook in hooks:
            hook.remove()
    return cache, seen


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_inverted_keys_equal_the_keys_computed_before_rope(arch):
    model = tiny_model(arch)
    ids = _ids(0)
    cache, seen = _projections(model, ids)
    freqs, scales = rope_tables(model)
    for idx, layer in sieve_layers(cache):
        signals = layer_signals(layer, idx, len(cache.layers), 0, 1)
        assert not torch.allclose(signals.keys, seen[(idx, "k_proj")], atol=1e-3)  # RoPE did rotate them
        back = pre_rope_keys(signals.keys, signals.positions, torch.tensor(freqs[idx]), scales[idx])
        torch.testing.assert_close(back, seen[(idx, "k_proj")], atol=2e-5, rtol=1e-4)
        # the input row of a position: every head's pre-RoPE key, then every head's value
        x = kvzap_inputs(signals, torch.tensor(freqs[idx]), scales[idx])
        h, d = signals.num_kv_heads, signals.keys.shape[-1]
        pos = 17
        expected = torch.cat([seen[(idx, name)][0, :, pos].reshape(-1) for name in ("k_proj", "v_proj")])
        torch.testing.assert_close(x[0, pos], expected, atol=2e-5, rtol=1e-4)
        assert x.shape == (1, ids.shape[1], 2 * h * d)


def test_inversion_of_a_partial_rotary_written_out_in_numpy():
    """Pairs (x_i, x_{i+r/2}) rotated as the complex number x_i + i x_{i+r/2} times a e^{i p f_i}; dims past r kept."""
    rng = np.random.default_rng(0)
    d, half, a = 12, 4, 1.3
    x = rng.normal(size=(1, 2, 5, d))
    pos = np.tile(np.array([0, 3, 7, 100, 2047]), (1, 2, 1))
    freq = 1.0 / 10000 ** (np.arange(half) / half)
    z = (x[..., :half] + 1j * x[..., half: 2 * half]) * a * np.exp(1j * pos[..., None] * freq)
    rotated = np.concatenate([z.real, z.imag, x[..., 2 * half:]], axis=-1)
    back = pre_rope_keys(torch.tensor(rotated, dtype=torch.float32), torch.tensor(pos), torch.tensor(freq), a)
    np.testing.assert_allclose(back.numpy(), x, atol=2e-4)


@torch.no_grad()
def _kvzip_scores_by_eager_attention(model, ids, header: int) -> list[torch.Tensor]:
    """KVzip's chunk-normalised scores of a one-chunk context, from the eager attention weights of the
    reconstruction forward (context, then instruction + postfix + the context repeated), written out here."""
    prompt = ReconstructionPrompt.from_tokenizer(TOKENIZER)
    n = ids.shape[1]
    repeat = torch.tensor([[*prompt.first, *prompt.postfix]])
    full = torch.cat([ids, repeat, ids[:, header:]], dim=1)
    eager = sharpened(tiny_model("llama"))
    eager.set_attn_implementation("eager")
    out = []
    for weights in eager(input_ids=full, output_attentions=True).attentions:  # (1, 4, N, N)
        w = weights[:, :, n:, :]  # the reconstruction queries
        # the softmax restricted to header + the chunk (here the whole context) + reconstruction tokens is the
        # full one: nothing is left out for a single chunk
        out.append(w[..., :n].reshape(1, 2, 2, -1, n).amax(dim=(2, 3)))
    return out


def test_targets_are_the_log_of_kvzip_scores_rederived_from_eager_attention():
    model = sharpened(tiny_model("llama"))
    ids = _ids(1)
    header = len(HEADER)
    rope = rope_tables(model)
    rows = collect_sequence(model, TOKENIZER, Episode(ids, ids[:, :0], "t"), rope, positions=40, seed=3)
    picked = rows["positions"]
    assert int(rows["header"]) == header and len(picked) == 40 and int(picked.min()) >= header
    assert picked.unique().numel() == 40
    expected = _kvzip_scores_by_eager_attention(model, ids, header)
    for layer in range(3):
        want = np.log(np.maximum(expected[layer][0][:, picked].double().numpy(), 1e-8)).T  # (P, H)
        np.testing.assert_allclose(rows["targets"][layer].numpy(), want, atol=1e-4, rtol=1e-4)
    assert rows["inputs"].shape == (3, 40, 2 * 2 * 16) and rows["inputs"].dtype == torch.float16


def test_stdlib_texts_are_deterministic_real_source_excerpts():
    first, again = stdlib_texts(3, 400, 5000), stdlib_texts(3, 400, 5000)
    assert first == again and len({name for name, _ in first}) == 3
    assert all(name.startswith("stdlib:") and name.endswith(".py") and len(text) > 200 for name, text in first)
    assert stdlib_texts(3, 400, 5001) != first


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = sharpened(tiny_model("llama"))
    out = tmp_path_factory.mktemp("kvzap")
    episodes = [("random", Episode(_ids(10 + i), _ids(10 + i)[:, :0], f"r{i}")) for i in range(40)]
    config = KVzapTrainConfig(model="tiny-llama", samples=0, text_docs=40, positions=64, hidden=16, steps=200,
                              lr=1e-2, ridge=10.0, holdout=0.25, out=str(out))
    return model, config, episodes, train_kvzap(config, model, TOKENIZER, progress=False, episodes=episodes)


def test_training_lowers_the_heldout_loss_below_a_constant_predictors(trained):
    model, config, episodes, result = trained
    losses = result.report["losses"]
    assert result.report["heldout_sequences"] == 10 and result.report["heldout_rows_per_layer"] == 10 * 64
    # a random tiny model's KVzip scores are only partly predictable from its keys and values
    assert losses["linear"] < 0.9 * losses["constant"], losses
    assert losses["mlp"] < 0.8 * losses["constant"], losses
    # both losses recomputed here from the saved rows: the last 10 sequences held out, the constant predictor
    # the training rows' mean per layer and head, the linear variant a plain matmul on standardised inputs
    import json

    from safetensors import safe_open
    from safetensors.numpy import load_file

    by_name = {}
    for f in (result.out / "kvzap-data").glob("*.safetensors"):
        with safe_open(str(f), framework="np") as handle:
            by_name[json.loads(handle.metadata()["key"])["name"]] = f
    rows = [load_file(str(by_name[e.name])) for _, e in episodes]  # in the training order
    x_tr = np.concatenate([r["inputs"] for r in rows[:30]], axis=1).astype(np.float64)
    y_tr = np.concatenate([r["targets"] for r in rows[:30]], axis=1).astype(np.float64)
    x_te = np.concatenate([r["inputs"] for r in rows[30:]], axis=1).astype(np.float64)
    y_te = np.concatenate([r["targets"] for r in rows[30:]], axis=1).astype(np.float64)
    constant = ((y_tr.mean(axis=1, keepdims=True) - y_te) ** 2).mean()
    np.testing.assert_allclose(losses["constant"], constant, rtol=1e-4)
    net, meta = load_kvzap(result.policy)
    state = {k: v.double().numpy() for k, v in net.state_dict().items()}
    np.testing.assert_allclose(state["mean"], x_tr.mean(axis=1), atol=2e-3, rtol=2e-3)  # the training rows'
    z = (x_te - state["mean"][:, None]) / state["std"][:, None]
    pred = np.einsum("lnd,ldh->lnh", z, state["linear_weight"]) + state["linear_bias"][:, None]
    assert ((pred - y_te) ** 2).mean() < 0.9 * constant  # float16 weights in the file: close to the reported loss
    np.testing.assert_allclose(((pred - y_te) ** 2).mean(), losses["linear"], rtol=2e-2)
    assert meta["variant"] == ("mlp" if losses["mlp"] <= losses["linear"] else "linear")
    assert len(list((result.out / "kvzap-data").glob("*.safetensors"))) == 40
    log = result.log.read_text().splitlines()
    assert log[0] == "step,train_loss,heldout_loss,seconds" and len(log) == 1 + 20


def test_a_rerun_reuses_the_collected_data_and_fits_the_same(trained):
    model, config, episodes, result = trained
    again = train_kvzap(config, model, TOKENIZER, progress=False, episodes=episodes)
    assert again.report["losses"] == result.report["losses"]
    assert again.report["collection_seconds_this_run"] < result.report["collection_seconds_this_run"]


def test_collected_rows_are_keyed_by_the_dtype_the_model_computes_in(trained, tmp_path):
    # a model passed in (or dtype "auto" on another machine) may compute in another dtype than the config says
    model, config, episodes, result = trained
    shutil.copytree(result.out / "kvzap-data", tmp_path / "kvzap-data")
    here = dataclasses.replace(config, out=str(tmp_path))
    before = len(list((tmp_path / "kvzap-data").glob("*.safetensors")))
    same, _ = collect_rows(here, model, TOKENIZER, progress=False, episodes=episodes[:2])
    assert len(list((tmp_path / "kvzap-data").glob("*.safetensors"))) == before  # float32: read back
    other, _ = collect_rows(here, copy.deepcopy(model).to(torch.bfloat16), TOKENIZER, progress=False,
                            episodes=episodes[:2])
    assert len(list((tmp_path / "kvzap-data").glob("*.safetensors"))) == before + 2  # bfloat16: collected anew
    assert not torch.equal(same[0]["targets"].float(), other[0]["targets"].float())  # computed in bfloat16


def test_the_policy_scores_predicted_log_kvzip_and_spends_a_global_budget(trained):
    model, _, _, result = trained
    policy = KVzap(checkpoint=str(result.policy), model="tiny-llama")
    assert policy.selection.allocation == "global" and policy.selection.sink == len(HEADER)
    ids = _ids(99)
    with kvsieve.attach(model, policy, ratio=0.5):
        cache = model(input_ids=ids, use_cache=True).cache
    n = ids.shape[1]
    kept = [int(layer.valid.sum()) if layer.valid is not None else layer.positions.numel()
            for _, layer in sieve_layers(cache)]
    assert sum(kept) == 3 * 2 * round(n * 0.5)  # the global budget, exactly: layers x heads x kept
    for _, layer in sieve_layers(cache):  # the header is kept in every head
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        for h in range(2):
            assert set(range(len(HEADER))) <= set(layer.positions[0, h][valid[0, h]].tolist())
    # scores equal the network on the inputs, layer by layer (the linear variant: a matmul written out)
    linear = KVzap(checkpoint=str(result.policy), variant="linear")
    full, _ = _projections(model, ids)
    net, meta = load_kvzap(result.policy)
    for idx, layer in sieve_layers(full):
        signals = layer_signals(layer, idx, 3, 0, 1)
        x = kvzap_inputs(signals, torch.tensor(meta["rope"]["inv_freq"][idx]), 1.0)[0].double()
        z = (x - net.mean[idx].double()) / net.std[idx].double()
        want = (z @ net.linear_weight[idx].double() + net.linear_bias[idx].double()).T
        torch.testing.assert_close(linear.score(signals)[0].double(), want, atol=1e-4, rtol=1e-4)
    assert policy.overhead_calls == 3 and policy.overhead_seconds > 0


def test_a_checkpoint_refuses_another_model(trained):
    _, _, _, result = trained
    with pytest.raises(ValueError, match="trained for model 'tiny-llama', not 'smollm2-135m'"):
        KVzap(checkpoint=str(result.policy), model="smollm2-135m")
    policy = KVzap(checkpoint=str(result.policy))
    other = tiny_model("qwen2")  # the same cache geometry, another config
    with pytest.raises(ValueError, match="same geometry but another config"):
        policy.check_model(other)
    with pytest.raises(ValueError, match="not 'qwen2.5-0.5b'"):
        policy.check_model(other, "qwen2.5-0.5b")
    cache, _ = _projections(tiny_model("llama"), _ids(0))
    signals = layer_signals(sieve_layers(cache)[1][1], 1, 3, 0, 1)
    signals.keys, signals.values = signals.keys[:, :1], signals.values[:, :1]  # another geometry: one KV head
    signals.positions = signals.positions[:, :1]
    with pytest.raises(ValueError, match="1 KV heads"):
        policy.score(signals)


def test_bad_inputs_give_clear_errors(trained, tmp_path):
    _, _, _, result = trained
    with pytest.raises(ValueError, match="kvzap needs checkpoint"):
        KVzap()
    with pytest.raises(ValueError, match="neither a file nor a shipped name"):
        KVzap(checkpoint=str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="variant 'cubic'"):
        KVzap(checkpoint=str(result.policy), variant="cubic")
    with pytest.raises(ValueError, match="allocation 'everywhere'"):
        KVzap(checkpoint=str(result.policy), allocation="everywhere")
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(result.policy.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ValueError, match="corrupt"):
        KVzap(checkpoint=str(damaged))
    with pytest.raises(ValueError, match="holdout"):
        KVzapTrainConfig(holdout=1.0)
    with pytest.raises(ValueError, match="unknown task"):
        KVzapTrainConfig(tasks=["niah_nowhere"])


SURROGATE_PROGRAM = '"""Twice the surrogate."""\n\n\ndef score(f):\n    return 2.0 * f.surrogate\n'


def test_evolved_programs_read_the_surrogate_as_a_feature(trained, monkeypatch):
    model, _, _, result = trained
    net, meta = load_kvzap(result.policy)
    rope = [torch.tensor(f) for f in meta["rope"]["inv_freq"]]
    program = ProgramPolicy(source=SURROGATE_PROGRAM, surrogate=str(result.policy), window=1)
    assert program.reads_surrogate and not ProgramPolicy(source=SEEDS["tova"]).reads_surrogate
    with kvsieve.attach(model, FullCache(window=1), ratio=0.0):
        cache = model(input_ids=_ids(7), use_cache=True).cache
    layers = sieve_layers(cache)
    for idx, layer in layers:
        signals = layer_signals(layer, idx, 3, 0, 1)
        want = 2.0 * net(kvzap_inputs(signals, rope[idx]), idx, meta["variant"])  # the checkpoint's default variant
        torch.testing.assert_close(program.score(signals), want.transpose(1, 2), atol=1e-4, rtol=1e-4)
    # without a surrogate: refused where none ships for the model, and when scoring
    bare = ProgramPolicy(source=SURROGATE_PROGRAM, window=1)
    with pytest.raises(ValueError, match="no kvzap surrogate ships for model 'tiny-llama'"):
        bare.check_model(model, "tiny-llama")
    with pytest.raises(ValueError, match="reads f.surrogate but has no surrogate"):
        bare.score(signals)
    # a shipped surrogate is found by the model it was trained for (name, geometry, config) and bound
    monkeypatch.setattr(shipped_module, "CHECKPOINT_DIR", result.policy.parent)
    monkeypatch.setattr(shipped_module, "SHIPPED", {("kvzap", "tiny-llama"): result.policy.name})
    assert shipped_kvzap_for(tiny_model("qwen2")) is None
    assert shipped_kvzap_for(model, "another-model") is None
    bare.check_model(model, "tiny-llama")
    torch.testing.assert_close(bare.score(signals), program.score(signals))


def test_dev_sets_carry_the_shipped_surrogates_predictions(trained, monkeypatch, tmp_path):
    model, _, _, result = trained
    monkeypatch.setattr(shipped_module, "CHECKPOINT_DIR", result.policy.parent)
    monkeypatch.setattr(shipped_module, "SHIPPED", {("kvzap", "tiny-llama"): result.policy.name})
    sample = Sample(id="d0", task="niah_single_1", context="the number is 4711. " * 4, question="Which number?",
                    answer_prefix="It is", answers=["4711"], max_new_tokens=4, length=0, seed=0,
                    metric="string_match_all")
    dev = DevSet(model, TOKENIZER, [sample], ratios=[0.5], window=4, workdir=tmp_path)
    features = load_features(dev.features_path)
    linear = KVzap(checkpoint=str(result.policy))
    for idx, layer in sieve_layers(dev.items[0].cache):
        signals = layer_signals(layer, idx, 3, window=4)
        torch.testing.assert_close(features[f"s0-l{idx}"].surrogate, linear.score(signals))
        assert features[f"s0-l{idx}"].surrogate.abs().sum() > 0
    monkeypatch.setattr(shipped_module, "SHIPPED", {})  # no surrogate for the model: the feature is zeros
    plain = load_features(DevSet(model, TOKENIZER, [sample], ratios=[0.5], window=4, workdir=tmp_path / "b")
                          .features_path)
    assert all(float(f.surrogate.abs().sum()) == 0.0 for f in plain.values())
    # a named checkpoint replaces the shipped one, in the same workdir: its prefill is keyed apart, never read back
    other = random_kvzap(model, tmp_path / "other.safetensors", header=2, seed=1)
    named = DevSet(model, TOKENIZER, [sample], ratios=[0.5], window=4, workdir=tmp_path, surrogate=str(other))
    features = load_features(named.features_path)
    for idx, layer in sieve_layers(named.items[0].cache):
        signals = layer_signals(layer, idx, 3, window=4)
        want = KVzap(checkpoint=str(other)).score(signals)
        torch.testing.assert_close(features[f"s0-l{idx}"].surrogate, want)
        assert not torch.allclose(want, linear.score(signals))
    foreign = random_kvzap(tiny_model("qwen2"), tmp_path / "foreign.safetensors", name="tiny-qwen2")
    with pytest.raises(ValueError, match="tiny-qwen2"):
        DevSet(model, TOKENIZER, [sample], ratios=[0.5], window=4, surrogate=str(foreign))


@torch.no_grad()
def test_decode_mode_scores_each_entry_once_and_keeps_the_score_with_it(tmp_path):
    """Decode-time eviction prunes heads apart, so kvzap cannot read every head at a position any more: the
    engine keeps each entry's score and kvzap scores only the entries appended since. Every remembered score
    must equal the checkpoint's linear map (numpy) of that entry's own pre-RoPE keys and values over the heads,
    recorded by hooks on k_proj / v_proj as the run computed them (later entries depend on the pruned cache)."""
    model = tiny_model("llama")
    path = random_kvzap(model, tmp_path / "kvzap.safetensors", header=2)
    policy = KVzap(checkpoint=str(path))
    net, _ = load_kvzap(path)
    recorded: dict[tuple[int, str], list[torch.Tensor]] = {}
    hooks = []
    for idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            hooks.append(getattr(attn, name).register_forward_hook(
                lambda m, a, out, idx=idx, name=name, d=attn.head_dim: recorded.setdefault((idx, name), []).append(
                    out.view(*out.shape[:2], -1, d).transpose(1, 2))))
    ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    try:
        with kvsieve.attach(model, policy, ratio=0.5, mode="decode", chunk_size=16, evict_every=3) as session:
            out = model(input_ids=ids, use_cache=True)
            cache = out.cache
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(7):  # generated tokens: evicted every 3
                out = model(input_ids=token, cache=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
    finally:
        for hook in hooks:
            hook.remove()
    assert session.report.events >= 5
    layers = sieve_layers(cache)
    assert any(len({frozenset(layer.positions[0, h].tolist()) for h in range(2)}) > 1 for _, layer in layers)
    checked = 0
    for idx, layer in layers:
        keys, values = (torch.cat(recorded[(idx, name)], 2)[0].double().numpy() for name in ("k_proj", "v_proj"))
        x = np.concatenate([keys.transpose(1, 0, 2).reshape(keys.shape[1], -1),
                            values.transpose(1, 0, 2).reshape(values.shape[1], -1)], axis=1)  # (N, 2 h d)
        mean, std = net.mean[idx].double().numpy(), net.std[idx].double().numpy()
        want = ((x - mean) / std) @ net.linear_weight[idx].double().numpy() + net.linear_bias[idx].double().numpy()
        layer.densify()
        memo, positions = layer.entry_scores[0], layer.positions[0]
        valid = torch.ones_like(positions, dtype=torch.bool) if layer.valid is None else layer.valid[0]
        for h in range(memo.shape[0]):
            scored = valid[h] & ~torch.isnan(memo[h])
            assert not torch.isnan(memo[h][valid[h]][: int(scored.sum())]).any()  # unscored ones only at the end
            got = memo[h][scored].double().numpy()
            np.testing.assert_allclose(got, want[positions[h][scored].numpy(), h], rtol=1e-4, atol=1e-4)
            checked += int(scored.sum())
    assert checked > 100
    # prefill mode scores once: nothing is remembered
    with kvsieve.attach(model, policy, ratio=0.5):
        cache = model(input_ids=ids, use_cache=True).cache
    assert all(layer.entry_scores is None for _, layer in sieve_layers(cache))
    # a program reading f.surrogate mixes it with other features, so nothing is remembered: prefill mode only
    program = ProgramPolicy(source=SURROGATE_PROGRAM, surrogate=str(path), window=4)
    with pytest.raises(ValueError, match="a program reading f.surrogate runs in prefill mode"):
        with kvsieve.attach(model, program, ratio=0.5, mode="decode", chunk_size=16):
            model(input_ids=ids, use_cache=True)
