"""What KVzip's context reconstruction costs next to a plain prefill.

Run: python benchmarks/kvzip_cost.py --model smollm2-135m --length 2048 --repeats 3
The context is generated prose cut to --length tokens inside the chat template (as the grid builds it).
Prints medians over --repeats runs after one warm-up of: the plain model's prefill, the prefill under
kvsieve.attach with kvzip (prefill + reconstruction + selection, both allocations), and the
reconstruction alone on a captured cache for both normalisations.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import kvsieve
from kvsieve.engine.generate import build_prompt
from kvsieve.engine.reconstruct import ReconstructionPrompt, reconstruction_scores
from kvsieve.models import load
from kvsieve.policies import FullCache
from kvsieve.tasks.haystack import prose


def context_text(tokenizer, length: int) -> str:
    sentences = 64
    while True:
        text = prose(sentences, seed=0)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return tokenizer.decode(ids[:length])
        sentences *= 2


def timed(fn, repeats: int) -> tuple[list[float], object]:
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def show(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} s (runs: {', '.join(f'{t:.2f}' for t in times)})"


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
          f"header), {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")

    plain, _ = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), args.repeats)
    print(f"plain prefill: {show(plain)}")
    base = statistics.median(plain)

    with kvsieve.attach(model, FullCache(window=1), ratio=0.0):
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).cache
    for normalization in ("chunk", "full"):
        times, rec = timed(lambda n=normalization: reconstruction_scores(model, cache, ids, rebuild,
                                                                         normalization=n), args.repeats)
        print(f"reconstruction alone ({normalization}): {show(times)} = {statistics.median(times) / base:.2f}x the "
              f"plain prefill ({rec.chunks} chunks, {rec.tokens} tokens forwarded)")

    for allocation in ("global", "uniform"):
        policy = kvsieve.policies.get("kvzip", tokenizer=tokenizer, allocation=allocation)

        def run(policy=policy):
            with kvsieve.attach(model, policy, ratio=args.ratio) as session:
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
            return session.report

        times, report = timed(run, args.repeats)
        print(f"prefill + kvzip({allocation}) @ {args.ratio}: {show(times)} = {statistics.median(times) / base:.2f}x "
              f"the plain prefill; inside it compression (reconstruction + selection + gather) {report.seconds:.3f} s; "
              f"{report.summary()}")


if __name__ == "__main__":
    main()
