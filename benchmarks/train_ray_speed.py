"""REINFORCE steps per second with the rollouts here and on Ray with 1 and 2 workers (kvsieve.learn.ray_rollouts).

    OMP_NUM_THREADS=1 python benchmarks/train_ray_speed.py configs/train-kvzap-smollm2.toml 5 [local,1,2]

Trains ``steps`` steps from the config's warm start (no held-out evaluations, the curriculum off so every step
runs every budget: K x budgets rollouts), once per arm, each in a fresh folder; the driver's model and
episodes are loaded once, each Ray arm starts its workers (not timed: ``start`` waits until they are built).
Prints, per arm, the steps' seconds (log.csv; every step is on a new request here, so each includes that
request's prefill and full-cache teacher), steps/s, and whether the arm's weights equal the local arm's.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvsieve.learn.ray_rollouts import RayRollouts
from kvsieve.learn.train import train
from kvsieve.learn.train_config import load_config, load_episodes
from kvsieve.models import dtype_name, load
from kvsieve.networks.kvzap_net import load_kvzap


def main() -> None:
    config_path, steps = sys.argv[1], int(sys.argv[2])
    arms = (sys.argv[3] if len(sys.argv) > 3 else "local,1,2").split(",")
    torch.set_num_threads(1)
    base = load_config(config_path)
    base = dataclasses.replace(base, steps=steps, eval_every=0, patience=0, curriculum_steps=0, save_every=steps)
    model, tokenizer = load(base.model, dtype=base.dtype)
    episodes = load_episodes(base, tokenizer)
    results, weights = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            config = dataclasses.replace(base, out=str(Path(tmp) / arm))
            remote = None
            if arm != "local":
                remote = RayRollouts(workers=int(arm))
                remote.start(config, episodes, config.model, dtype_name(model))
            try:
                wall = time.perf_counter()
                result = train(config, model=model, episodes=episodes, progress=False, remote=remote)
                wall = time.perf_counter() - wall
            finally:
                if remote is not None:
                    remote.close()
            seconds = sum(r["seconds"] for r in result.history)
            weights[arm] = [t.clone() for t in load_kvzap(result.policy)[0].state_dict().values()]
            results.append({"arm": arm, "steps": len(result.history), "steps_seconds": round(seconds, 1),
                            "wall_seconds": round(wall, 1), "steps_per_s": round(len(result.history) / seconds, 4),
                            "equal_to_first_arm": all(torch.equal(a, b) for a, b in
                                                      zip(weights[arm], weights[arms[0]]))})
            print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
