"""Engine speed and memory: prefill overhead of each policy, cache bytes kept, decode tokens/s.

Run: python benchmarks/engine_speed.py --model qwen2.5-0.5b --length 4096
Prints a Markdown table (used in the README). Timings are medians over --repeats runs after one
warm-up; "compress ms" is the time spent scoring, selecting and gathering (measured inside the
engine), "overhead" compares the whole prefill under the policy with the plain model's prefill.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import kvsieve
import kvsieve.engine.cache
from kvsieve.models import load
from kvsieve.tasks.haystack import prose


def context_ids(tokenizer, length: int) -> torch.Tensor:
    sentences = 64
    while True:
        ids = tokenizer(prose(sentences, seed=0), add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return torch.tensor([ids[:length]])
        sentences *= 2


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio for the prefill rows")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--policies", default=",".join(kvsieve.policies.names()))
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    ids = context_ids(tokenizer, args.length)
    machine = platform.processor() or platform.machine()
    print(f"# {args.model}, {args.length} tokens, {torch.get_num_threads()} threads, {machine}")
    plain, _ = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), args.repeats)
    print(f"plain prefill: {plain:.3f} s\n")
    print("| policy | prefill s | overhead | compress ms | compress / prefill | cache MiB kept (of full) |")
    print("|---|---|---|---|---|---|")
    for name in args.policies.split(","):
        policy = kvsieve.policies.get(name)

        def run(policy=policy):
            with kvsieve.attach(model, policy, ratio=args.ratio) as session:
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            return session.report, kvsieve.engine.cache.cache_bytes(out.cache)

        seconds, (report, kept) = timed(run, args.repeats)
        full = report.bytes_before if report.layers else kept
        print(f"| {name} | {seconds:.3f} | {100 * (seconds / plain - 1):+.1f}% | {1000 * report.seconds:.1f} | "
              f"{100 * report.seconds / plain:.2f}% | {kept / 2**20:.1f} ({full / 2**20:.1f}) |", flush=True)

    print("\n| ratio | kept tokens/layer | cache MiB | decode tokens/s |")
    print("|---|---|---|---|")
    for ratio in (0.0, 0.5, 0.875):
        with kvsieve.attach(model, kvsieve.policies.get("snapkv"), ratio=ratio) as session:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = out.cache
            start = time.perf_counter()
            # no EOS stop: force exactly --decode-tokens steps by decoding with an empty EOS set
            tokens = _decode_fixed(model, cache, out.logits[:, -1], args.decode_tokens)
            rate = tokens / (time.perf_counter() - start)
        mib = kvsieve.engine.cache.cache_bytes(cache) / 2**20
        print(f"| {ratio} | {max(session.kept_tokens)} | {mib:.1f} | {rate:.1f} |", flush=True)


def _decode_fixed(model, cache, logits, steps: int) -> int:
    for _ in range(steps):
        token = logits.argmax(dim=-1, keepdim=True)
        logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    return steps


if __name__ == "__main__":
    main()
