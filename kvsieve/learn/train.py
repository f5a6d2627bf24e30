"""``kvsieve train``: one entry point, three objectives.

- ``reinforce`` (default): DistillCache's REINFORCE on the per-step KL reward (:mod:`kvsieve.learn.reinforce`);
- ``imitate``: the same network regressed on KVzip's scores, the supervised ablation (:mod:`kvsieve.learn.imitate`);
- ``kvzap``: the per-layer KVzip surrogate (:mod:`kvsieve.learn.kvzap_train`).

Every objective resumes from ``config.out`` and writes ``policy.safetensors`` there (or the surrogate's
checkpoint), which ``learned(checkpoint=...)`` / ``kvzap(checkpoint=...)`` load.
"""

from __future__ import annotations

from kvsieve.learn.imitate import imitate
from kvsieve.learn.kvzap_train import KVzapTrainConfig, train_kvzap
from kvsieve.learn.ray_rollouts import check_remote_config
from kvsieve.learn.reinforce import reinforce
from kvsieve.learn.rollout import Episode
from kvsieve.learn.train_config import TrainConfig, TrainResult, load_episodes, load_heldout
from kvsieve.models import load

__all__ = ["train"]


def train(config: TrainConfig, model=None, tokenizer=None, episodes: list[Episode] | None = None,
          progress: bool = True, heldout: list[Episode] | None = None, remote=None) -> TrainResult:
    """Train (or resume, when ``config.out`` holds a checkpoint of the same settings) up to ``config.steps``.

    ``model``/``tokenizer`` default to ``kvsieve.models.load(config.model)``; ``episodes`` default to the
    generated tasks (seeds from ``config.seed``) plus ``config.data``; ``heldout`` (the stopping rule's requests,
    when ``config.eval_every``) to ``eval_samples`` per task from ``config.eval_seed``. ``remote``: REINFORCE's
    rollouts on Ray actors (:class:`kvsieve.learn.ray_rollouts.RayRollouts`, refused for other objectives and
    decode mode before anything loads; the caller closes it).
    """
    if remote is not None:
        check_remote_config(config)
    if config.objective == "kvzap":  # the KVzip surrogate: its own data (RULER + stdlib text) and fit
        result = train_kvzap(KVzapTrainConfig.from_train_config(config), model, tokenizer, progress)
        return TrainResult(result.out, result.policy, result.policy, result.log, result.log, result.step,
                           result.history)
    if model is None:
        model, tokenizer = load(config.model, dtype=config.dtype)
    if episodes is None:
        if tokenizer is None:
            raise ValueError("give a tokenizer (or episodes) to build the training samples")
        episodes = load_episodes(config, tokenizer)
    if not episodes:
        raise ValueError("no training episodes")
    if config.objective == "imitate":
        return imitate(config, model, tokenizer, episodes, progress)
    if config.eval_every and heldout is None:
        if tokenizer is None:
            raise ValueError("give a tokenizer (or held-out episodes) to build the held-out requests")
        heldout = load_heldout(config, tokenizer)
    return reinforce(config, model, episodes, progress, heldout, remote)
