"""Learned eviction (kvsieve.learn): sampling, reward, network, policy, checkpoints, training and resume."""

from __future__ import annotations

import copy
import itertools
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import COMMON, episode
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.compress import layer_signals
from kvsieve.learn.reinforce import reinforce_loss
from kvsieve.learn.reward import kl_per_position, teacher_from_logits
from kvsieve.learn.rollout import (
    Decision,
    Episode,
    RolloutPolicy,
    _RecordingSelection,
    decision_terms,
    rollout,
    teacher_for,
)
from kvsieve.learn.sampling import (
    first_choice_entropy,
    gumbel_noise,
    gumbel_top_k,
    log_prob_of_ordered,
    log_prob_of_set_bruteforce,
)
from kvsieve.learn.train import train
from kvsieve.learn.train_config import TrainConfig
from kvsieve.networks.checkpoint import load_checkpoint, save_checkpoint
from kvsieve.networks.keep_features import FEATURES, extract
from kvsieve.networks.keep_net import KeepNet
from kvsieve.networks.model_shape import ModelShape
from kvsieve.policies import FullCache, from_spec
from kvsieve.policies.learned import LearnedPolicy

# ---------------------------------------------------------------------------------------------- sampling


def _pl_probability(logits: list[float], order: tuple[int, ...]) -> float:
    """Plackett-Luce probability of an ordered draw, written out independently of the library."""
    weights = [math.exp(x) for x in logits]
    left, p = sum(weights), 1.0
    for i in order:
        p *= weights[i] / left
        left -= weights[i]
    return p


def test_ordered_log_prob_matches_the_written_out_product_and_sums_to_one():
    logits = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7], dtype=torch.float64)
    for k in (1, 2, 3, 5):
        orders = list(itertools.permutations(range(5), k))
        lp = log_prob_of_ordered(logits.expand(len(orders), -1), torch.tensor(orders))
        expected = torch.tensor([_pl_probability(logits.tolist(), o) for o in orders], dtype=torch.float64)
        torch.testing.assert_close(lp.exp(), expected, rtol=1e-10, atol=0)
        assert float(lp.exp().sum()) == pytest.approx(1.0, abs=1e-12)  # every ordered k-subset, once


def test_set_log_prob_by_enumeration_is_the_sum_over_its_orders():
    logits = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7], dtype=torch.float64)
    total = 0.0
    for subset in itertools.combinations(range(5), 3):
        by_hand = sum(_pl_probability(logits.tolist(), o) for o in itertools.permutations(subset))
        assert math.exp(log_prob_of_set_bruteforce(logits, list(subset))) == pytest.approx(by_hand, rel=1e-10)
        total += by_hand
    assert total == pytest.approx(1.0, abs=1e-12)


def test_gumbel_top_k_samples_the_plackett_luce_distribution():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    draws = 40_000
    orders = gumbel_top_k(logits.expand(draws, -1), 2, torch.Generator().manual_seed(0))
    pairs = list(itertools.permutations(range(4), 2))
    counts = torch.zeros(len(pairs))
    codes = orders[:, 0] * 4 + orders[:, 1]
    for j, (a, b) in enumerate(pairs):
        counts[j] = int((codes == a * 4 + b).sum())
    expected = torch.tensor([_pl_probability(logits.tolist(), p) for p in pairs]) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 32.9  # 99.95% quantile of chi-square with 11 degrees of freedom


def test_log_prob_with_excluded_entries_has_finite_gradients():
    logits = torch.tensor([[0.5, 1.0, -0.3, 0.2, 0.0]], requires_grad=True)
    excluded = torch.tensor([False, True, False, False, True])
    masked = logits.masked_fill(excluded, float("-inf"))
    lp = log_prob_of_ordered(masked, torch.tensor([[3, 0, 2]]))  # every free entry drawn: nothing left over
    (lp.sum() + first_choice_entropy(masked).sum()).backward()
    assert torch.isfinite(logits.grad).all() and float(logits.grad[0, 1]) == 0.0
    free = [0.5, -0.3, 0.2]  # the order restricted to the free entries 0, 2, 3
    assert float(lp.detach().exp()) == pytest.approx(_pl_probability(free, (2, 0, 1)), rel=1e-6)


# ---------------------------------------------------------------------------------------------- reward


def test_kl_of_equal_logits_is_exactly_zero_and_positive_otherwise():
    logits = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    for top_k in (None, 8):
        teacher = teacher_from_logits(logits, top_k=top_k)
        assert torch.equal(kl_per_position(teacher, logits.clone()), torch.zeros(6))
        assert bool((kl_per_position(teacher, logits + torch.randn(6, 128)) > 0).all())
    full = kl_per_position(teacher_from_logits(logits, top_k=None), logits * 2)
    coarse = kl_per_position(teacher_from_logits(logits, top_k=8), logits * 2)
    assert bool((coarse <= full + 1e-6).all())  # binning never raises a KL


def _episode(seed: int, n: int = 96, m: int = 24) -> Episode:
    return episode(seed, n, m)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_kl_reward_is_zero_when_nothing_is_evicted(llama, mode):
    episode, net = _episode(0), KeepNet()
    shape = ModelShape.of(llama, "tiny-llama")
    teacher = teacher_for(llama, episode, mode, 8, 16, 32)
    keep_all = episode.context.shape[1] if mode == "prefill" else episode.ids.shape[1]
    policy = RolloutPolicy(net, shape, 8, torch.Generator().manual_seed(0))
    nothing = rollout(llama, episode, policy, mode, keep_all, 16, teacher)
    assert not nothing.decisions and nothing.reward == 0.0 and torch.equal(nothing.kl, torch.zeros_like(nothing.kl))
    evicting = rollout(llama, episode, policy, mode, 40, 16, teacher)
    assert evicting.decisions and evicting.reward < 0


# ---------------------------------------------------------------------------------------------- network, features


def test_network_is_small_and_scores_every_entry():
    net = KeepNet()
    floats = len(FEATURES) - 1  # the last column is the layer index, embedded in 8 dimensions
    embedding, first, second, out = 64 * 8, (floats + 8) * 64 + 64, 64 * 64 + 64, 64 + 1
    assert net.num_parameters() == embedding + first + second + out == 5953 < 50_000
    features = torch.randn(2, 3, 7, len(FEATURES))
    features[..., -1] = 5.0  # layer index
    assert net(features).shape == (2, 3, 7)
    features[..., -1] = 64.0
    with pytest.raises(ValueError, match="outside the network's 64 layer embeddings"):
        net(features)


def _last_query_logits(layer, idx) -> torch.Tensor:
    """q . k * scaling of the last captured query of each query head against every cached key (no mask needed)."""
    query = layer.recent_queries[0, :, -1].float()  # (q_heads, d)
    keys = layer.keys[0].float().repeat_interleave(query.shape[0] // layer.keys.shape[1], dim=0)  # (q_heads, n, d)
    return torch.einsum("hd,hnd->hn", query, keys) * layer.scaling


@torch.no_grad()
def test_features_are_finite_and_scaled(llama, prompt_ids):
    with kvsieve.attach(llama, FullCache(window=8), ratio=0.0):
        cache = llama(input_ids=prompt_ids, use_cache=True).cache
    layers = sieve_layers(cache)
    for idx, layer in layers:
        f = extract(layer_signals(layer, idx, len(layers), window=8))
        assert f.shape == (1, 2, 96, len(FEATURES)) and f.dtype == torch.float32 and torch.isfinite(f).all()
        named = dict(zip(FEATURES, f.unbind(-1)))
        assert bool((named["layer"] == idx).all()) and bool((named["depth"] == idx / 2).all())
        assert 0 <= float(named["rel_position"].min()) and float(named["rel_position"].max()) == 1.0
        assert float(named["recency"][..., -1].max()) == 0.0 and float(named["recency"].max()) <= 1.0
        assert 0 <= float(named["attn_entropy"].min()) and float(named["attn_entropy"].max()) <= 1.0 + 1e-5
        assert abs(float(named["value_norm"].exp().mean(-1).mean()) - 1) < 1e-4  # norm over its layer mean
        # the last query's attention, averaged over the group's query heads (2 per KV head), times n, log1p
        probs = torch.softmax(_last_query_logits(layer, idx), dim=-1)  # (q_heads, n)
        expected = torch.log1p(96 * probs.view(2, 2, 96).mean(dim=1))
        torch.testing.assert_close(named["attn_last"][0], expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- REINFORCE on a toy


def _bandit(generator: torch.Generator) -> tuple[torch.Tensor, int]:
    features = torch.randn(1, 1, 12, len(FEATURES), generator=generator) * 0.3
    features[..., -1] = 0.0
    key = int(torch.randint(0, 10, (), generator=generator))
    features[0, 0, key, FEATURES.index("value_norm")] = 2.0
    return features, key


def _keep_probability(net: KeepNet, generator: torch.Generator, trials: int = 200) -> float:
    """Exact probability that the one free draw is the key entry, averaged over fresh bandits."""
    total = 0.0
    with torch.no_grad():
        for _ in range(trials):
            features, key = _bandit(generator)
            total += math.exp(log_prob_of_set_bruteforce(net(features)[0, 0, :10], [key]))
    return total / trials


def test_reinforce_learns_to_keep_the_one_informative_entry():
    """A bandit with a known answer: 12 entries, keep 3 (the last 2 protected, 1 free draw among 10); the
    reward is -1 unless the entry whose value norm stands out is kept (the KL that only it removes). The
    draws go through the same selection, network and loss as training, with a running-mean baseline."""
    torch.manual_seed(0)
    net = KeepNet()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.02)
    noise = torch.Generator().manual_seed(1)
    before = _keep_probability(net, torch.Generator().manual_seed(2))
    selection, rewards = _RecordingSelection(recent=2), []
    for _ in range(40):
        features, key = _bandit(noise)
        selection.decisions.clear()
        selection.decisions.append(Decision(time=12, layer=0, features=features))
        with torch.no_grad():
            scores = net(features) + gumbel_noise((1, 1, 12), noise)
        indices, _ = selection.kept_indices(scores, 3)
        reward = 0.0 if key in indices.flatten().tolist() else -1.0
        baseline = sum(rewards[-10:]) / len(rewards[-10:]) if rewards else 0.0
        loss, _ = reinforce_loss(net, selection.decisions, {12: reward}, {12: baseline}, entropy_coef=0.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rewards.append(reward)
    after = _keep_probability(net, torch.Generator().manual_seed(2))
    assert before < 0.3 and after > 0.9, (before, after)  # a uniform draw keeps it 1 time in 10
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10


# ---------------------------------------------------------------------------------------------- policy, checkpoints

CONFIG = dict(model="tiny-llama", chunk_size=16, window=8, ratios=[0.5, 0.75], save_every=1, rollouts=2)


@pytest.fixture(scope="module")
def trained(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("learned")
    result = train(TrainConfig(steps=2, mode="prefill", out=str(out), **CONFIG), model=llama,
                   episodes=[_episode(i) for i in range(3)], progress=False)
    return result


def test_training_writes_a_log_a_curve_and_a_checkpoint_that_round_trips(trained):
    assert trained.step == 2 and len(trained.history) == 2
    assert trained.log.read_text().splitlines()[0].startswith("step,episode,ratio,reward,kl,greedy_reward")
    assert trained.curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = load_checkpoint(trained.policy)
    model = saved.meta["model"]
    assert {k: model[k] for k in ("name", "num_layers", "num_kv_heads", "head_dim")} == {
        "name": "tiny-llama", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16}
    assert model["config"]["vocab_size"] == 128 and model["config"]["hidden_size"] == 64
    assert len(model["fingerprint"]) == 16 and int(model["fingerprint"], 16) >= 0
    assert saved.meta["features"] == list(FEATURES) and saved.meta["window"] == 8 and saved.meta["step"] == 2
    assert saved.meta["train"]["mode"] == "prefill" and not saved.group("optim")
    state = load_checkpoint(trained.checkpoint)
    assert state.group("optim") and "baseline.mean" in state.tensors
    policy = LearnedPolicy(checkpoint=str(trained.out))  # the run folder finds policy.safetensors
    for name, value in policy.net.state_dict().items():
        assert torch.equal(value, saved.tensors[f"net.{name}"]) and torch.equal(value, state.tensors[f"net.{name}"])
    assert policy.window == 8 and policy.trained_for.name == "tiny-llama"
    spec = from_spec(f"learned(checkpoint='{trained.policy}')")
    assert spec.net.state_dict().keys() == policy.net.state_dict().keys()


@torch.no_grad()
def test_learned_policy_compresses_in_prefill_mode_and_reports_its_overhead(llama, prompt_ids, trained):
    policy = LearnedPolicy(checkpoint=str(trained.policy), model="tiny-llama")
    with kvsieve.attach(llama, policy, ratio=0.5):
        cache = llama(input_ids=prompt_ids, use_cache=True).cache
    for _, layer in sieve_layers(cache):
        assert layer.physical_length == 48
        assert set(range(88, 96)) <= set(layer.positions[0, 0].tolist())  # the window is kept
    assert policy.overhead_calls == 3 and policy.overhead_seconds > 0 and policy.overhead_ms_per_call > 0


@torch.no_grad()
def test_decode_time_eviction_with_the_learned_policy_stays_under_budget_plus_chunk(llama, prompt_ids, trained):
    budget, chunk = 32, 16
    seen = []

    def record(module, args, output):
        seen.append((module.layer_idx, session.cache.layers[module.layer_idx].physical_length))

    hooks = [m.self_attn.register_forward_hook(record) for m in llama.model.layers]
    try:
        policy = LearnedPolicy(checkpoint=str(trained.policy))
        with kvsieve.attach(llama, policy, kept=budget, mode="decode", chunk_size=chunk) as session:
            out = llama.generate(prompt_ids, max_new_tokens=10, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert out.shape[1] == 106 and len(seen) >= 3 * (96 // chunk + 9)
    assert max(length for _, length in seen) <= budget + chunk
    assert session.report.events >= 4 and policy.overhead_calls >= 3 * 4


def _damaged(path, tmp_path, name, edit):
    data = bytearray(path.read_bytes())
    target = tmp_path / name
    target.write_bytes(bytes(edit(data)))
    return str(target)


def test_corrupt_truncated_and_foreign_checkpoints_are_refused(trained, tmp_path):
    good = trained.policy

    def flip_last_byte(data):
        data[-1] ^= 0xFF
        return data

    corrupt = _damaged(good, tmp_path, "corrupt.safetensors", flip_last_byte)
    with pytest.raises(ValueError, match="is corrupt: its tensors do not match the checksum"):
        LearnedPolicy(checkpoint=corrupt)
    truncated = _damaged(good, tmp_path, "truncated.safetensors", lambda d: d[: len(d) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        LearnedPolicy(checkpoint=truncated)
    garbage = _damaged(good, tmp_path, "garbage.safetensors", lambda d: b"\x00\x01 not a checkpoint" * 3)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        LearnedPolicy(checkpoint=garbage)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a kvsieve learned-policy checkpoint"):
        LearnedPolicy(checkpoint=str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="neither a file nor a shipped name"):
        LearnedPolicy(checkpoint=str(tmp_path / "missing.safetensors"))


@torch.no_grad()
def test_a_checkpoint_refuses_another_model(trained, prompt_ids):
    with pytest.raises(ValueError, match="trained for model 'tiny-llama', not 'qwen2.5-0.5b'"):
        LearnedPolicy(checkpoint=str(trained.policy), model="qwen2.5-0.5b")
    torch.manual_seed(0)
    other = AutoModelForCausalLM.from_config(LlamaConfig(**dict(COMMON, num_key_value_heads=1)),
                                             attn_implementation="sdpa").eval()
    policy = LearnedPolicy(checkpoint=str(trained.policy))
    with pytest.raises(ValueError, match=r"trained for model 'tiny-llama' \(3 layers, 2 KV heads, head dim 16\); "
                                         r"the model it is applied to has 3 layers, 1 KV heads"):
        with kvsieve.attach(other, policy, ratio=0.5):
            other(input_ids=prompt_ids, use_cache=True)


def test_learned_without_a_checkpoint_says_what_is_shipped_and_how_to_train():
    with pytest.raises(ValueError, match=r"shipped: qwen2.5-coder-0.5b-instruct, smollm2-135m-instruct\); train one "
                       r"with `kvsieve train"):
        from_spec("learned")
    # listed with every family a user can call, marked as needing a file like program:PATH
    assert kvsieve.policies.families()["learned"] == kvsieve.policies.families()["program"] == "file"
    assert kvsieve.policies.families()["oracle"] == "reference"
    assert "learned" not in kvsieve.policies.names(kinds=("policy",))


# the models' published configurations: layers, KV heads, head dim
@pytest.mark.parametrize("name,alias,other,shape", [
    ("smollm2-135m-instruct", "smollm2-135m", "qwen2.5-0.5b", (30, 3, 64)),
    ("qwen2.5-coder-0.5b-instruct", "qwen2.5-0.5b", "smollm2-135m", (24, 2, 64)),
])
def test_shipped_checkpoints_load_by_name_for_their_model_only(name, alias, other, shape):
    policy = from_spec(f"learned(checkpoint={alias!r}, model={name!r})")
    shipped = policy.trained_for
    assert shipped.name == name and (shipped.num_layers, shipped.num_kv_heads, shipped.head_dim) == shape
    assert load_checkpoint(policy.checkpoint).meta["kvsieve_train"] == "reinforce-kl"
    with pytest.raises(ValueError, match=f"was trained for model {name!r}, not {other!r}"):
        from_spec(f"learned(checkpoint={name!r}, model={other!r})")


# ---------------------------------------------------------------------------------------------- training


def test_decode_training_resumes_to_the_same_weights(llama, tmp_path):
    episodes = [_episode(i) for i in range(3)]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    config = dict(CONFIG, mode="decode", baseline="greedy")
    train(TrainConfig(steps=4, out=str(straight), **config), model=llama, episodes=episodes, progress=False)
    train(TrainConfig(steps=2, out=str(resumed), **config), model=llama, episodes=episodes, progress=False)
    train(TrainConfig(steps=4, out=str(resumed), **config), model=llama, episodes=episodes, progress=False)
    a, b = load_checkpoint(straight / "checkpoint.safetensors"), load_checkpoint(resumed / "checkpoint.safetensors")
    assert a.meta["step"] == b.meta["step"] == 4 and a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    logged = (resumed / "log.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in logged[1:]] == ["0", "1", "2", "3"]
    with pytest.raises(ValueError, match=r"other settings \(lr: 0.003 there, 0.01 now\)"):
        train(TrainConfig(steps=5, out=str(resumed), lr=0.01, **config), model=llama, episodes=episodes,
              progress=False)
    shutil.rmtree(tmp_path)


def test_a_run_refuses_to_resume_in_another_dtype(llama, tmp_path):
    # dtype "auto" picks bfloat16 on one machine and float32 on another: a resumed run must not mix them
    episodes = [_episode(i) for i in range(2)]
    config = dict(CONFIG, mode="prefill")
    train(TrainConfig(steps=1, out=str(tmp_path), **config), model=llama, episodes=episodes, progress=False)
    assert load_checkpoint(tmp_path / "checkpoint.safetensors").meta["dtype"] == "float32"
    bf16 = copy.deepcopy(llama).to(torch.bfloat16)
    with pytest.raises(ValueError, match="computed in float32, this one computes in bfloat16: pass --dtype float32"):
        train(TrainConfig(steps=2, out=str(tmp_path), **config), model=bf16, episodes=episodes, progress=False)
    assert load_checkpoint(tmp_path / "checkpoint.safetensors").meta["step"] == 1  # nothing was overwritten
    result = train(TrainConfig(steps=2, out=str(tmp_path), **config), model=llama, episodes=episodes, progress=False)
    assert result.step == 2


def test_mean_baseline_training_keeps_its_running_mean_in_the_checkpoint(llama, tmp_path):
    result = train(TrainConfig(steps=2, out=str(tmp_path), mode="decode", baseline="mean", **CONFIG), model=llama,
                   episodes=[_episode(i) for i in range(2)], progress=False)
    assert all(math.isnan(row["greedy_reward"]) for row in result.history)
    assert all(row["reward"] < 0 and row["decisions"] > 0 for row in result.history)
    mean = load_checkpoint(result.checkpoint).tensors["baseline.mean"]
    assert mean.numel() > 0 and float(mean.max()) < 0  # returns are minus a KL


def test_bad_train_settings_name_the_value_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"compression ratio 1.5 is outside \(0, 1\)"):
        TrainConfig(ratios=[1.5])
    with pytest.raises(ValueError, match="mode 'fast' is not one of decode, prefill"):
        TrainConfig(mode="fast")
    with pytest.raises(ValueError, match="baseline 'best' is not one of greedy, mean"):
        TrainConfig(baseline="best")
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['nope'\]"):
        TrainConfig(tasks=["nope"])
    from kvsieve.cli import main

    assert main(["train", "--ratios", "0.5,x"]) == 2
    assert main(["train", "--chunk-size", "0"]) == 2


# ---------------------------------------------------------------------------------------------- mutants of training
# Each test below fails for one plausible break of the training maths (issue 17): the KL taken the wrong
# way round, the protected entries left in the Plackett-Luce denominators, a zero advantage.


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    weights = [math.exp(x - top) for x in row]
    return [w / sum(weights) for w in weights]


def _kl(p: list[float], q: list[float]) -> float:
    """KL(p || q) written out: sum p log(p / q)."""
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def test_kl_reward_is_teacher_to_student_not_the_reverse():
    g = torch.Generator().manual_seed(3)
    teacher_logits = torch.randn(4, 16, generator=g, dtype=torch.float64) * 2
    student_logits = torch.randn(4, 16, generator=g, dtype=torch.float64) * 2
    got = kl_per_position(teacher_from_logits(teacher_logits, top_k=None), student_logits)
    for t in range(4):
        p, q = _softmax(teacher_logits[t].tolist()), _softmax(student_logits[t].tolist())
        assert abs(_kl(p, q) - _kl(q, p)) > 0.05  # the two directions differ here
        assert float(got[t]) == pytest.approx(_kl(p, q), rel=1e-5)
    # binned: the teacher's 3 most likely tokens and one bin for the rest, the same bins for both
    binned = kl_per_position(teacher_from_logits(teacher_logits, top_k=3), student_logits)
    for t in range(4):
        p, q = _softmax(teacher_logits[t].tolist()), _softmax(student_logits[t].tolist())
        top = sorted(range(16), key=lambda i: -p[i])[:3]
        p_bins = [p[i] for i in top] + [1 - sum(p[i] for i in top)]
        q_bins = [q[i] for i in top] + [1 - sum(q[i] for i in top)]
        assert float(binned[t]) == pytest.approx(_kl(p_bins, q_bins), rel=1e-5)


def test_decision_log_prob_draws_from_the_free_entries_only():
    """The ordered draw's probability over the unprotected entries, written out; protected entries never
    enter a denominator (they are kept whatever the draw)."""
    torch.manual_seed(0)
    net = KeepNet()
    features = torch.randn(1, 2, 7, len(FEATURES)) * 0.5
    features[..., -1] = 1.0  # layer 1
    protected = torch.tensor([True, False, False, False, False, True, True])
    order = torch.tensor([[[3, 1]], [[2, 4]]]).view(1, 2, 2)
    log_probs, _, draws = decision_terms(net, [Decision(time=7, layer=1, features=features, protected=protected,
                                                        order=order)])
    with torch.no_grad():
        logits = net(features)[0]
    free = [i for i in range(7) if not bool(protected[i])]
    expected = 0.0
    for head in range(2):
        row = {i: float(logits[head, i]) for i in free}
        left, p = sum(math.exp(v) for v in row.values()), 1.0
        for i in order[0, head].tolist():
            p *= math.exp(row[i]) / left
            left -= math.exp(row[i])
        expected += math.log(p)
    assert draws == 4 and float(log_probs[7].detach()) == pytest.approx(expected, rel=1e-5)


def _policy_log_prob(net: KeepNet, decisions: list[Decision]) -> dict[int, float]:
    """Per decision time, log p of the drawn orders under ``net``, from plain Python sums."""
    out: dict[int, float] = {}
    with torch.no_grad():
        for d in decisions:
            logits = net(d.features)
            free = (~d.protected).nonzero().flatten().tolist()
            for b in range(logits.shape[0]):
                for h in range(logits.shape[1]):
                    left = sum(math.exp(float(logits[b, h, i])) for i in free)
                    for i in d.order[b, h].tolist():
                        w = math.exp(float(logits[b, h, i]))
                        out[d.time] = out.get(d.time, 0.0) + math.log(w / left)
                        left -= w
    return out


def test_a_training_step_moves_the_policy_along_the_advantage(llama, tmp_path, monkeypatch):
    """One REINFORCE step with the running-mean baseline (zero before the first step) and no entropy
    bonus: every decision's advantage is its reward-to-go, minus a KL, so negative; the step must change
    the weights and lower sum_t -A_t log p_t (make the drawn, penalised keep sets less likely)."""
    import kvsieve.learn.reinforce as train_module

    config = TrainConfig(steps=1, mode="prefill", baseline="mean", entropy_coef=0.0, rollouts=1, lr=1e-3,
                         out=str(tmp_path), **{k: v for k, v in CONFIG.items() if k not in ("rollouts",)})
    trainer = train_module.Trainer(config, llama, ModelShape.of(llama, "tiny-llama"), [_episode(0)])
    seen = []
    real = train_module.reinforce_loss
    monkeypatch.setattr(train_module, "reinforce_loss", lambda *a, **k: seen.append(a) or real(*a, **k))
    before = copy.deepcopy(trainer.net)
    row = trainer.run_step()
    (_, decisions, returns, baseline, *_), = seen
    assert decisions and returns and all(r < 0 for r in returns.values()) and not any(baseline.values())
    assert row["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), trainer.net.state_dict().values()))
    old, new = _policy_log_prob(before, decisions), _policy_log_prob(trainer.net, decisions)
    objective = {name: -sum(returns[t] * lp[t] for t in returns) for name, lp in (("old", old), ("new", new))}
    assert objective["new"] < objective["old"], objective


# ---------------------------------------------------------------------------------------------- model fingerprint


def test_check_model_refuses_a_model_of_the_same_geometry_with_another_config(llama, trained):
    policy = LearnedPolicy(checkpoint=str(trained.policy))
    policy.check_model(llama)
    policy.check_model(llama, "tiny-llama")
    with pytest.raises(ValueError, match="trained for model 'tiny-llama', not 'smollm2-135m'"):
        policy.check_model(llama, "smollm2-135m")
    same_shape = SimpleNamespace(config=LlamaConfig(**dict(COMMON, vocab_size=256, intermediate_size=96)))
    with pytest.raises(ValueError, match=r"same geometry but another config \(fingerprint [0-9a-f]{16}, not "
                                         r"[0-9a-f]{16}: intermediate_size 96, not 128; vocab_size 256, not 128\)"):
        policy.check_model(same_shape)
    fewer_heads = SimpleNamespace(config=LlamaConfig(**dict(COMMON, num_key_value_heads=1)))
    with pytest.raises(ValueError, match="the model it is applied to has 3 layers, 1 KV heads"):
        policy.check_model(fewer_heads)


# the bundled models' configs as kvsieve loads them from their GGUF files (published SmolLM2-135M-Instruct and
# Qwen2.5-Coder-0.5B-Instruct values; the GGUF of Qwen carries its own output matrix, so embeddings are untied)
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu")
QWEN = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                   rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")


@pytest.mark.parametrize("name,config", [("smollm2-135m-instruct", SMOLLM2), ("qwen2.5-coder-0.5b-instruct", QWEN)])
def test_shipped_checkpoints_accept_their_model_and_refuse_a_random_one_of_its_geometry(name, config):
    policy = from_spec(f"learned(checkpoint={name!r})")
    assert policy.trained_for.fingerprint is not None
    policy.check_model(SimpleNamespace(config=config), name)
    # a randomly initialised Llama / Qwen2 of the same geometry, with the library's other defaults
    geometry = {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads")}
    random_one = SimpleNamespace(config=type(config)(**geometry))
    with pytest.raises(ValueError, match="same geometry but another config"):
        policy.check_model(random_one)


def test_a_checkpoint_without_a_fingerprint_is_checked_on_name_and_geometry(trained, tmp_path):
    loaded = load_checkpoint(trained.policy)
    meta = {k: v for k, v in loaded.meta.items() if k not in ("format", "features", "sha256")}
    meta["model"] = {k: v for k, v in meta["model"].items() if k not in ("fingerprint", "config")}
    old = save_checkpoint(tmp_path / "old.safetensors", meta, loaded.tensors)
    policy = LearnedPolicy(checkpoint=str(old))
    assert policy.trained_for.fingerprint is None
    policy.check_model(SimpleNamespace(config=LlamaConfig(**dict(COMMON, vocab_size=256))))  # nothing to compare
    with pytest.raises(ValueError, match="1 KV heads"):
        policy.check_model(SimpleNamespace(config=LlamaConfig(**dict(COMMON, num_key_value_heads=1))))
