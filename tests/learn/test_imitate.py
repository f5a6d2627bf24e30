"""The supervised ablation (kvsieve.learn.imitate): targets, collection and a short regression run."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import HEADER, TOKENIZER, episode

from kvsieve.learn.imitate import collect, imitation_loss, imitation_targets
from kvsieve.learn.rollout import Episode
from kvsieve.learn.train import train
from kvsieve.learn.train_config import TrainConfig
from kvsieve.networks.checkpoint import load_checkpoint
from kvsieve.networks.keep_features import FEATURES
from kvsieve.networks.keep_net import KeepNet
from kvsieve.policies.learned import LearnedPolicy


def test_targets_are_standardised_log_scores_of_the_free_entries():
    scores = torch.rand(1, 2, 12, generator=torch.Generator().manual_seed(0))
    targets, mask = imitation_targets(scores, header=3, window=4)
    for head in range(2):
        free = np.log(scores[0, head, 3:8].double().numpy() + 1e-8)
        expected = (free - free.mean()) / free.std()  # population std, written out independently
        np.testing.assert_allclose(targets[0, head, 3:8].numpy(), expected, rtol=1e-4, atol=1e-5)
        assert targets[0, head, :3].abs().sum() == 0 and targets[0, head, 8:].abs().sum() == 0
    assert mask[0, 0].tolist() == [False] * 3 + [True] * 5 + [False] * 4


def test_constant_scores_give_zero_targets_not_nan():
    targets, mask = imitation_targets(torch.full((1, 1, 10), 0.25), header=0, window=2)
    assert torch.isfinite(targets).all() and targets.abs().sum() == 0 and int(mask.sum()) == 8


def _episode(seed: int) -> Episode:
    return episode(seed, 80, 8, header=True)


def test_collect_gives_features_and_targets_for_every_layer(llama):
    layers = collect(llama, TOKENIZER, _episode(0), window=8)
    assert len(layers) == llama.config.num_hidden_layers
    n = _episode(0).context.shape[1]
    for features, targets, mask in layers:
        assert features.shape[:3] == targets.shape == mask.shape == (1, 2, n)
        assert not mask[..., : len(HEADER)].any() and not mask[..., -8:].any() and mask.sum() > 0
        assert torch.isfinite(features).all() and torch.isfinite(targets).all()


def test_imitation_lowers_the_regression_loss_and_writes_a_loadable_policy(llama, tmp_path):
    episodes = [_episode(i) for i in range(3)]
    config = TrainConfig(model="tiny-llama", objective="imitate", steps=300, lr=1e-2, window=8, out=str(tmp_path))
    data = [collect(llama, TOKENIZER, e, window=8) for e in episodes]
    result = train(config, model=llama, tokenizer=TOKENIZER, episodes=episodes, progress=False)
    policy = LearnedPolicy(checkpoint=str(result.policy), model="tiny-llama")
    with torch.no_grad():
        after = float(sum(imitation_loss(policy.net, layers) for layers in data)) / len(data)
    # the targets have mean 0 and variance 1 per head: predicting a constant scores 1 at best (a random
    # tiny model's KVzip scores are only partly predictable from the features)
    assert after < 0.95, after
    assert load_checkpoint(result.policy).meta["kvsieve_train"] == "imitate-kvzip"
    assert result.log.read_text().splitlines()[0] == "step,episode,loss,seconds"
    assert result.curve.is_file() and (tmp_path / "imitation-data.safetensors").is_file()
    # a rerun reads the collected set back and ends with the same weights
    again = train(config, model=llama, tokenizer=TOKENIZER, episodes=episodes, progress=False)
    first, second = load_checkpoint(result.policy), load_checkpoint(again.policy)
    assert all(torch.equal(first.tensors[k], second.tensors[k]) for k in first.tensors)
    assert result.history[0]["seconds"] > 0


def test_the_collected_set_is_keyed_by_the_dtype_the_model_computes_in(llama, tmp_path):
    # the config's dtype is usually "auto", which resolves per machine: the key must hold the model's own
    from safetensors import safe_open

    episodes = [_episode(0)]
    config = TrainConfig(model="tiny-llama", objective="imitate", steps=1, window=8, out=str(tmp_path))
    path = tmp_path / "imitation-data.safetensors"

    def stored() -> tuple[str, torch.Tensor]:
        with safe_open(str(path), framework="pt") as handle:
            return handle.metadata()["key"], handle.get_tensor("0.0.targets")

    train(config, model=llama, tokenizer=TOKENIZER, episodes=episodes, progress=False)
    key32, targets32 = stored()
    assert config.dtype == "auto" and "'dtype': 'float32'" in key32
    train(config, model=copy.deepcopy(llama).to(torch.bfloat16), tokenizer=TOKENIZER, episodes=episodes,
          progress=False)
    key16, targets16 = stored()  # collected again, not the float32 set read back
    assert "'dtype': 'bfloat16'" in key16
    assert not torch.equal(targets16.float(), targets32.float())


def test_the_regression_recovers_a_target_that_is_a_feature():
    g = torch.Generator().manual_seed(0)
    features = torch.rand(1, 2, 50, len(FEATURES), generator=g)
    features[..., -1] = 1.0  # layer index
    targets, mask = imitation_targets(torch.exp(3 * features[..., 0]), header=2, window=4)
    torch.manual_seed(0)
    net = KeepNet()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(300):
        optimizer.zero_grad()
        loss = imitation_loss(net, [(features, targets, mask)])
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.02


def test_reinforce_can_start_from_an_imitation_checkpoint(llama, tmp_path):
    from kvsieve.learn.reinforce import Trainer as _Trainer
    from kvsieve.networks.model_shape import ModelShape

    episodes = [_episode(i) for i in range(2)]
    imitated = train(TrainConfig(model="tiny-llama", objective="imitate", steps=5, window=8, out=str(tmp_path / "a")),
                     model=llama, tokenizer=TOKENIZER, episodes=episodes, progress=False)
    config = TrainConfig(model="tiny-llama", mode="prefill", window=8, init=str(imitated.policy),
                         out=str(tmp_path / "b"))
    trainer = _Trainer(config, llama, ModelShape.of(llama, "tiny-llama"), episodes)
    start = load_checkpoint(imitated.policy).group("net")
    assert all(torch.equal(trainer.net.state_dict()[k], v) for k, v in start.items())
    with pytest.raises(ValueError, match="init checkpoint .* was trained for"):
        _Trainer(config, llama, ModelShape(name="other", num_layers=3, num_kv_heads=2, head_dim=16), episodes)
    with pytest.raises(ValueError, match="holds a network"):
        _Trainer(TrainConfig(model="tiny-llama", mode="prefill", window=8, hidden=32, init=str(imitated.policy)),
                 llama, ModelShape.of(llama, "tiny-llama"), episodes)


def test_bad_objective_is_named():
    with pytest.raises(ValueError, match="objective 'distill' is not one of reinforce, imitate"):
        TrainConfig(objective="distill")
