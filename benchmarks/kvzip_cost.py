"""What KVzip's context reconstruction costs next to a plain prefill.

Run: python benchmarks/kvzip_cost.py --model smollm2-135m --length 2048 --repeats 3
The context is generated prose cut to --length tokens inside the chat template (as the grid builds it).
Prints medians over --repeats rounds after one warm-up round of: the plain model's prefill, the
reconstruction alone on a captured cache (both normalisations), and the prefill under kvsieve.attach
with kvzip (prefill + reconstruction + selection + gather, both allocations). The cases run interleaved
within each round, and each is also given as a ratio to the plain prefill of its own round, which
is steadier than absolute seconds on a shared machine; so is process CPU time, printed as well.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import kvsieve
from kvsieve.engine.reconstruct import ReconstructionPrompt, reconstruction_scores
from kvsieve.models import load
from kvsieve.policies import FullCache
from kvsieve.prompt import build_prompt
from kvsieve.tasks.haystack import prose


def context_text(tokenizer, length: int) -> str:
    sentences = 64
    while True:
        text = prose(sentences, seed=0)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return tokenizer.decode(ids[:length])
        sentences *= 2


def show(times: list[float], base: list[float]) -> str:
    ratios = [t / b for t, b in zip(times, base)]
    runs, each = ", ".join(f"{t:.1f}" for t in times), ", ".join(f"{r:.2f}" for r in ratios)
    return (f"{statistics.median(times):.2f} s = {statistics.median(ratios):.2f}x the plain prefill "
            f"(runs: {runs} s; same-round ratios {each})")


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5)
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    prompt = build_prompt(tokenizer, context_text(tokenizer, args.length), "What is the special number?")
    ids = prompt.context_ids
    rebuild = ReconstructionPrompt.from_tokenizer(tokenizer)
    print(f"# {args.model} ({model.dtype}), {ids.shape[1]} prompt tokens ({rebuild.header_length(ids)} template "
          f"header), {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    with kvsieve.attach(model, FullCache(window=1), ratio=0.0):
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).cache

    def attached(allocation: str):
        policy = kvsieve.policies.get("kvzip", tokenizer=tokenizer, allocation=allocation)
        with kvsieve.attach(model, policy, ratio=args.ratio) as session:
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return session.report

    runs = {
        "plain prefill": lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1),
        "reconstruction alone (chunk)": lambda: reconstruction_scores(model, cache, ids, rebuild),
        "reconstruction alone (full)": lambda: reconstruction_scores(model, cache, ids, rebuild, normalization="full"),
        f"prefill + kvzip @ {args.ratio} (global)": lambda: attached("global"),
        f"prefill + kvzip @ {args.ratio} (uniform)": lambda: attached("uniform"),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}  # process CPU seconds: less hit by other jobs
    results = {}
    for round_ in range(args.repeats + 1):  # round 0 warms up; each round runs every case once, interleaved
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = run()
            if round_:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    for name in runs:
        print(f"{name}: wall {show(times[name], times['plain prefill'])}")
        print(f"{' ' * len(name)}  CPU  {show(cpu[name], cpu['plain prefill'])}")
    rec = results["reconstruction alone (chunk)"]
    print(f"reconstruction: {rec.chunks} chunks, {rec.tokens} tokens forwarded")
    for name, report in results.items():
        if "kvzip" in name:
            print(f"{name}: compression {report.seconds:.2f} s in the engine (reconstruction + selection + gather); "
                  f"{report.summary()}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
