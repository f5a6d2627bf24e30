"""REINFORCE's rollouts on Ray actors (``kvsieve train --ray``): the same training, its rollouts spread out.

One training step runs K rollouts at each active budget on one request (:meth:`Trainer.step_plan
<kvsieve.learn.reinforce.Trainer.step_plan>`). Each rollout's costly part is the model's forward over the
continuation on its compressed cache and the KL to the full cache's distributions (and, once per request,
the context's prefill and the full-cache teacher). Here that part runs on long-lived Ray actors
(:class:`~kvsieve.distributed.pool.WorkerPool`: each loads the model once, keeps its requests' prefills and
teachers, and a worker that dies is replaced and its rollout retried once). What the update needs stays in
the driver:

1. the driver sends the step's weights (one object in Ray's store) and, per rollout, the request, the kept
   count and the seed parts of its Gumbel noise; the actor runs :func:`~kvsieve.learn.rollout.rollout` with
   exactly the policy a local step builds (same weights, same seeded noise) and returns the per-position KL
   and each decision's time, protected entries and draw order, but not its inputs (for the surrogate, every
   layer's keys and values: tens of MB a rollout);
2. the driver compresses a copy of its own prefill of the request with the same seeded policy, which records
   each decision's inputs (no forward pass: scoring and selection only), takes the actor's draw order (the
   same on one machine; the one the reward belongs to anywhere) and goes on as a local step does: baselines,
   log-probabilities with gradients, trust region, Adam.

So a step's result does not depend on which worker ran which rollout, nor in which order they finished: with
the actors' and the driver's torch threads equal (one each), a Ray run ends with the weights a local run
ends with, and resuming after a kill is the local run's resume (the checkpoint holds everything; actors hold
only caches). Prefill mode only: in decode mode the decisions are made during the forward pass itself, so
the driver could not record them without redoing it. The held-out evaluations run in the driver.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from kvsieve.distributed.actors import RayActors
from kvsieve.distributed.cluster import import_ray
from kvsieve.distributed.pool import WorkerPool
from kvsieve.engine.cache import clone_cache
from kvsieve.engine.compress import compress_cache
from kvsieve.learn.reinforce import Trainer
from kvsieve.learn.rollout import Decision, Episode, Rollout, rollout
from kvsieve.learn.train_config import TrainConfig, seeded_generator
from kvsieve.models import load
from kvsieve.networks.model_shape import ModelShape
from kvsieve.selection import Budget

__all__ = ["RayRollouts", "RolloutWorker", "check_remote_config"]


def check_remote_config(config: TrainConfig) -> None:
    """Refuse what rollouts on Ray cannot do, naming it: decode mode, and objectives without rollouts."""
    if config.objective != "reinforce":
        raise ValueError(f"--ray spreads REINFORCE's rollouts; objective {config.objective!r} has none")
    if config.mode != "prefill":
        raise ValueError(f"--ray runs rollouts in prefill mode only, not {config.mode!r}: in decode mode a rollout's "
                         "decisions are made inside its forward pass, which the driver would have to redo")


class RolloutWorker:
    """The body of one Ray actor: the model (built once by ``factory``) and a trainer that only runs rollouts."""

    def __init__(self, factory: Callable, threads: int, config: dict, episodes: list[Episode], model_name: str):
        torch.set_num_threads(max(1, int(threads)))
        model = factory()[0]
        config = TrainConfig(**config)
        self.trainer = Trainer(config, model, ModelShape.of(model, model_name), episodes)
        self.step: int | None = None
        self.shared: dict = {}

    def pid(self) -> int:
        return os.getpid()

    def evaluate(self, weights: dict, step: int, index: int, kept: int, parts: tuple | None) -> Rollout:
        """One rollout of ``step`` on episode ``index`` with the step's ``weights``; decisions without inputs."""
        trainer = self.trainer
        if step != self.step:  # the step's weights; its rollouts share the scores of one cache (as locally)
            trainer.net.load_state_dict(weights)
            self.step, self.shared = step, {}
        c = trainer.config
        context_cache = trainer.context_cache(index)
        teacher = trainer.teacher(index, context_cache)
        policy = trainer.rollout_policy(None if parts is None else seeded_generator(*parts), record=False,
                                        shared=self.shared)
        result = rollout(trainer.model, trainer.episodes[index], policy, c.mode, kept, c.chunk_size, teacher,
                         context_cache)
        decisions = [Decision(d.time, d.layer, None, d.protected, d.order) for d in result.decisions]
        return Rollout(result.kl, result.start, decisions, result.overhead_seconds)


class RayRollouts(RayActors):
    """Rollouts on Ray actors (see the module docstring): ``address`` ``None`` starts a local Ray instance (shut
    down on :meth:`close`), ``"auto"`` or ``"HOST:PORT"`` joins a cluster; ``workers`` actors (default: the
    cluster's CPUs), each with ``cpus_per_worker`` CPUs and as many torch threads; ``factory()`` returns ``(model,
    tokenizer)`` in whichever process calls it (default: :func:`kvsieve.models.load` of the config's model and
    dtype, resolved in the driver); ``on_dispatch(pid, i)`` runs in the driver when a step's rollout ``i`` is sent to
    the worker with that process id."""

    def __init__(self, address: str | None = None, workers: int | None = None, cpus_per_worker: int = 1,
                 factory: Callable | None = None, on_dispatch: Callable[[int, int], None] | None = None) -> None:
        super().__init__(address, workers, cpus_per_worker, on_dispatch)
        self.factory = factory

    def pids(self) -> list[int]:
        """The workers' process ids (waits until they are built)."""
        return self._pool.pids() if self._pool is not None else []

    def start(self, config: TrainConfig, episodes: list[Episode], model_name: str, dtype: str) -> list[int]:
        """Start the workers and wait until each has built its model; returns their process ids."""
        check_remote_config(config)
        self._connect()
        if self._pool is None:
            factory = self.factory or functools.partial(load, config.model, dtype=dtype)
            self._pool = WorkerPool(RolloutWorker, (factory, self.cpus_per_worker, config.to_dict(), episodes,
                                                    model_name), cpus_per_worker=self.cpus_per_worker)
        self._pool.grow(self.size())
        return self._pool.pids()

    def rollouts(self, trainer, index: int, plan) -> list[list[Rollout]]:
        """Every rollout of ``plan`` (:meth:`Trainer.step_plan`) on the actors, with the driver's inputs."""
        if self._pool is None:
            raise ValueError("RayRollouts.start() was not called")
        ray = import_ray()
        weights = ray.put({k: v.detach().clone() for k, v in trainer.net.state_dict().items()})
        items = [(weights, trainer.step, index, kept, p) for _, kept, parts in plan for p in parts]
        remote: dict[int, Rollout] = {}
        self._run(self._pool, items, remote.__setitem__, list(range(len(items))),
                  describe=lambda i: f"rollout {i} of step {trainer.step}", ident=str)
        episode = trainer.episodes[index]
        context_cache = trainer.context_cache(index)
        total = episode.ids.shape[1]
        shared: dict = {}
        out, i = [], 0
        for _, kept, parts in plan:
            group = []
            for p in parts:
                result = remote[i]
                i += 1
                if p is not None:  # the decisions' inputs, recorded here by the same seeded policy
                    policy = trainer.rollout_policy(seeded_generator(*p), shared=shared)
                    compress_cache(clone_cache(context_cache), policy, Budget(kept=kept))
                    local = [d for d in policy.decisions if d.order is not None and d.time < total]
                    if [d.time for d in local] != [d.time for d in result.decisions]:
                        raise RuntimeError(f"step {trainer.step}: a worker's rollout decided at times "
                                           f"{[d.time for d in result.decisions]}, the driver's at "
                                           f"{[d.time for d in local]}")
                    for mine, theirs in zip(local, result.decisions):
                        mine.order = theirs.order  # the draw the reward belongs to
                    result = Rollout(result.kl, result.start, local, result.overhead_seconds)
                group.append(result)
            out.append(group)
        return out
