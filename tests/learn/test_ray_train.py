"""REINFORCE's rollouts on Ray actors (kvsieve.learn.ray_rollouts): a Ray run stopped after its first step and
resumed by a new driver with new actors ends with the rewards and weights of an uninterrupted local run (so a
Ray run equals a local one, and its resume is exact), and what Ray cannot do is refused by name.

The model is the tiny random Llama of ``tests/conftest.py`` (built by a picklable function, so actors build
their own copy) with a random surrogate; one local Ray instance (num_cpus=2), two one-thread workers.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import episode, random_kvzap, tiny_model

from kvsieve.learn.ray_rollouts import RayRollouts
from kvsieve.learn.train import train
from kvsieve.learn.train_config import TrainConfig
from kvsieve.networks.kvzap_net import load_kvzap

HERE = os.path.dirname(__file__)
TEST_PATHS = [HERE, os.path.dirname(HERE)]  # where actors find this module and conftest
sys.path.extend(p for p in TEST_PATHS if p not in sys.path)


def tiny_factory():
    """(model, tokenizer) built in whichever process calls it (an actor imports this module by name)."""
    return tiny_model("llama"), None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' threads: float32 sums split over two threads round differently
    path = random_kvzap(tiny_factory()[0], tmp_path_factory.mktemp("kvzap") / "kvzap.safetensors")
    try:
        yield path
    finally:
        torch.set_num_threads(torch_threads)


def _config(path, out, steps: int) -> TrainConfig:
    # the issue-51 method in small: every budget per step, K = 2 with leave-one-out, curriculum, trust region
    return TrainConfig(model="tiny-llama", network="kvzap", init=str(path), mode="prefill", temperature=0.5,
                       ratios=[0.5, 0.75], all_ratios=True, curriculum_steps=2, rollouts=2, baseline="loo",
                       entropy_coef=0.0, trust_coef=0.01, window=8, lr=1e-2, save_every=1, steps=steps, out=str(out))


EPISODES = [episode(i, 80, 12) for i in range(3)]


def _weights(result) -> list[torch.Tensor]:
    net, _ = load_kvzap(result.policy)
    return list(net.state_dict().values())


@pytest.mark.ray
def test_a_ray_run_stopped_and_resumed_by_a_new_driver_ends_as_an_uninterrupted_local_run(setup, tmp_path):
    import ray

    path = setup
    local = train(_config(path, tmp_path / "local", 3), model=tiny_factory()[0], episodes=EPISODES, progress=False)
    with pytest.MonkeyPatch.context() as patch:  # workers (started by the raylet) import test modules by name
        patch.setenv("PYTHONPATH", os.pathsep.join([*TEST_PATHS, *filter(None, [os.environ.get("PYTHONPATH")])]))
        ray.init(address="local", num_cpus=2, include_dashboard=False)
        try:
            runs = {}
            for name, stops in (("resumed", [1, 3]),):
                for steps in stops:  # a new driver and new actors for each part, as after a kill
                    sent: list[int] = []
                    remote = RayRollouts(workers=2, factory=tiny_factory,
                                         on_dispatch=lambda pid, i, s=sent: s.append(pid))
                    try:
                        runs[name] = train(_config(path, tmp_path / name, steps), model=tiny_factory()[0],
                                           episodes=EPISODES, progress=False, remote=remote)
                        # both workers ran rollouts, none ran in the driver
                        assert len(set(sent)) == 2 and os.getpid() not in sent
                    finally:
                        remote.close()
        finally:
            ray.shutdown()
    rewards = [r["reward"] for r in local.history]
    assert len(rewards) == 3 and len({round(r, 12) for r in rewards}) == 3  # three different steps
    for name in runs:
        assert runs[name].step == 3
        assert [r["reward"] for r in runs[name].history] == rewards
        assert all(torch.equal(a, b) for a, b in zip(_weights(runs[name]), _weights(local)))
    start, _ = load_kvzap(path)
    assert not torch.equal(_weights(local)[0], list(start.state_dict().values())[0])  # training moved the weights


def test_what_ray_cannot_do_is_refused_before_anything_starts(tmp_path):
    remote = RayRollouts(workers=1, factory=tiny_factory)  # connects only when started: nothing is started here
    with pytest.raises(ValueError, match="--ray runs rollouts in prefill mode only, not 'decode'"):
        train(TrainConfig(model="tiny-llama", mode="decode", out=str(tmp_path)), model=tiny_factory()[0],
              episodes=EPISODES, progress=False, remote=remote)
    with pytest.raises(ValueError, match="objective 'imitate' has none"):
        train(TrainConfig(model="tiny-llama", objective="imitate", mode="prefill", out=str(tmp_path)),
              model=tiny_factory()[0], episodes=EPISODES, progress=False, remote=remote)
    assert remote._connection is None


def test_the_cli_hands_ray_rollouts_to_training_and_closes_them(monkeypatch, tmp_path, capsys):
    import kvsieve.learn.ray_rollouts as ray_module
    import kvsieve.learn.train as train_module
    from kvsieve import cli
    from kvsieve.learn.train_config import TrainResult

    seen = []

    class Recorded(RayRollouts):
        def close(self):
            seen.append(("closed", self.address, self.workers))

    def fake_train(config, remote=None):
        seen.append(("train", type(remote).__name__))
        out = tmp_path / "r"
        return TrainResult(out, out / "policy.safetensors", out / "c", out / "log.csv", out / "curve.png", 0, [])

    monkeypatch.setattr(ray_module, "RayRollouts", Recorded)
    monkeypatch.setattr(train_module, "train", fake_train)
    assert cli.main(["train", "--ray", "--workers", "2", "--address", "auto", "--out", str(tmp_path / "r")]) == 0
    assert seen == [("train", "Recorded"), ("closed", "auto", 2)]
    assert cli.main(["train", "--workers", "2", "--out", str(tmp_path / "r")]) == 2
    assert "--ray-address and --workers go with --ray" in capsys.readouterr().err
