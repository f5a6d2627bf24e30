"""The same grid on the local executor and on Ray with 1 and 2 workers: speedup and Ray's overhead per task.

Run on a quiet machine: OMP_NUM_THREADS=1 python benchmarks/ray_speed.py 8 2048
(argument 1: samples per task, 2 tasks; argument 2: context length, >= 768). Model loads are not timed.
Prints local / ray-1 / ray-2 seconds, speedup_2_vs_1, overhead_s_per_task = (ray-1 - local) / samples
and whether the three stores hold equal rows.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from kvsieve.harness.executor import LocalGridExecutor
from kvsieve.harness.grid import GridConfig
from kvsieve.harness.ray_executor import RayGridExecutor
from kvsieve.harness.run import run_grid
from kvsieve.harness.store import ResultsStore


def rows(path: Path) -> dict:
    with ResultsStore(path) as store:
        return {r.key: (r.prediction, r.score) for r in store.rows()}


def main() -> None:
    samples, length = int(sys.argv[1]), int(sys.argv[2])
    grid = dict(model="smollm2-135m-instruct", tasks=["niah_single_1", "niah_single_2"], lengths=[length],
                policies=["full", "snapkv", "knorm", "tova"], ratios=[0.5, 0.875], samples=samples)
    seconds, folder = {}, Path(tempfile.mkdtemp())
    executors = [("local", LocalGridExecutor()), ("ray-1", RayGridExecutor(workers=1)),
                 ("ray-2", RayGridExecutor(workers=2))]
    for name, executor in executors:
        config = GridConfig(**grid, store=str(folder / f"{name}.sqlite"))
        if name == "local":
            executor.samples(config)
        else:
            executor.start(config)  # model loads are not timed
        start = time.perf_counter()
        run_grid(config, progress=False, executor=executor).close()
        seconds[name] = time.perf_counter() - start
        executor.close()
    n = 2 * samples
    same = rows(folder / "local.sqlite") == rows(folder / "ray-1.sqlite") == rows(folder / "ray-2.sqlite")
    print(json.dumps({**{k: round(v, 2) for k, v in seconds.items()}, "samples": n, "rows_equal": same,
                      "speedup_2_vs_1": round(seconds["ray-1"] / seconds["ray-2"], 2),
                      "overhead_s_per_task": round((seconds["ray-1"] - seconds["local"]) / n, 3)}))


if __name__ == "__main__":
    main()
