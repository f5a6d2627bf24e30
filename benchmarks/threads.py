"""OpenMP settings on a small shared machine: the CLI's default (passive wait) against OpenMP's own.

Run: python benchmarks/threads.py [--length 1024] [--busy 1]

Times one 1024-token SmolLM2 cell (``kvsieve eval``'s unit of work: prefill, a snapkv compression at
ratio 0.5, the question and 16 greedy tokens) in a fresh process per setting, because OpenMP reads its
environment once, when torch loads:

- ``omp-default``: OMP_WAIT_POLICY unset outside kvsieve (libgomp spins a while before sleeping), all cores;
- ``passive``: OMP_WAIT_POLICY=PASSIVE, all cores (what ``kvsieve`` sets unless the user chose);
- ``one-thread``: OMP_NUM_THREADS=1 (``kvsieve --threads 1``).

``--busy N`` starts N pure-Python busy loops beside the measurement, the "anything else running" of
issue 17 (set 0 on a quiet machine). Prints a Markdown table with the CPU, its flags, dtype and threads.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

CELL = r"""
import json, sys, time
import torch
from kvsieve.engine.generate import generate
from kvsieve.models import dtype_name, load
from kvsieve.policies import get
from kvsieve.tasks.ruler import generate as make_sample

model, tokenizer = load("smollm2-135m-instruct")
count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
sample = make_sample("niah_single_1", int(sys.argv[1]), 0, count, 80)
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    generate(model, tokenizer, sample.context, sample.question, get("snapkv"), ratio=0.5,
             answer_prefix=sample.answer_prefix, max_new_tokens=16)
    times.append(time.perf_counter() - start)
print(json.dumps({"seconds": sorted(times)[len(times) // 2], "threads": torch.get_num_threads(),
                  "dtype": dtype_name(model)}))
"""

SETTINGS = {
    "omp-default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "one-thread": {"OMP_NUM_THREADS": "1"},
}


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes running beside the cell")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    load = os.getloadavg()[0]  # other work already on the machine
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    rows = []
    try:
        for name, env in SETTINGS.items():
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CELL, str(args.length), str(args.repeats)],
                                 env={**base, **env}, capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((name, result, time.perf_counter() - start))
    finally:
        stop.set()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), []))
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] or ["no native bf16"]
    print(f"CPU: {cpu}, {os.cpu_count()} cores, {', '.join(bf16)}; {args.busy} busy process(es) beside the cell; "
          f"SmolLM2-135M-Instruct, niah_single_1 at {args.length} tokens, snapkv 0.5, 16 new tokens, median of "
          f"{args.repeats}; load average before: {load:.1f}\n")
    print("| setting | threads | dtype | seconds per cell |\n|---|---:|---|---:|")
    for name, result, _ in rows:
        print(f"| {name} | {result['threads']} | {result['dtype']} | {result['seconds']:.2f} |")


if __name__ == "__main__":
    main()
