"""Decode throughput and peak cache bytes under decode-time eviction, against the full cache.

Run: python benchmarks/decode_throughput.py --model smollm2-135m-instruct --length 8192 \
         --policies "full,learned(checkpoint=smollm2-135m-instruct)" --ratio 0.75 --batches 1,8

For each policy and batch size: ``batch`` prose contexts of ``length`` tokens (different seeds, equal
lengths: no padding) are read under ``kvsieve.attach(mode="decode", chunk_size=...)`` (the cache held
under the budget after every chunk), then ``--tokens`` tokens are generated greedily, one forward per
token, evicting once every ``--evict-every`` tokens (``attach(evict_every=...)``; 1 evicts after every
token). Printed per row:

* prefill seconds (reading the context in chunks, evictions included);
* decode tokens/s: ``batch * tokens / decode seconds``;
* peak cache bytes: ``Session.peak_cache_bytes``, the largest cache any forward held (before its
  eviction: the in-forward peak), and the full cache's bytes at the end (every token seen);
* policy ms per eviction: the time the policy's ``score`` takes for all layers of one eviction (the
  learned policy's features + network; other policies report the engine's compression seconds per
  event, which includes selection and the gather).

Timings are single runs (the contexts are long); quote the machine with them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from engine_speed import context_ids, cpu_name  # benchmarks/, run as a script

import kvsieve
from kvsieve.engine.cache import cache_bytes, full_cache_bytes
from kvsieve.models import cpu_flags, load
from kvsieve.policies import from_spec, split_specs


def contexts(tokenizer, length: int, batch: int) -> torch.Tensor:
    """``batch`` prose contexts of exactly ``length`` tokens (seeds 0..batch-1): no padding needed."""
    return torch.cat([context_ids(tokenizer, length, seed) for seed in range(batch)])


@torch.no_grad()
def measure(model, spec: str, ids: torch.Tensor, ratio: float, chunk_size: int, tokens: int,
            evict_every: int = 32) -> dict:
    policy = from_spec(spec)
    with kvsieve.attach(model, policy, ratio=ratio if policy.evicts else 0.0, mode="decode",
                        chunk_size=chunk_size, evict_every=evict_every) as session:
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        cache = out.cache
        events_before = session.report.events if session.report else 0
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=next_ids, cache=cache, use_cache=True)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        decode_s = time.perf_counter() - start
        report = session.report
        events = report.events if report else 0
        if hasattr(policy, "overhead_seconds"):
            per_event_ms = 1000 * policy.overhead_seconds / max(policy.overhead_calls, 1) * len(cache.layers)
        else:
            per_event_ms = 1000 * report.seconds / max(events, 1) if report and events else 0.0
        return {"policy": spec, "batch": ids.shape[0], "prefill_s": prefill_s,
                "tokens_per_s": ids.shape[0] * tokens / decode_s,
                "peak_bytes": max(session.peak_cache_bytes, cache_bytes(cache)),
                "full_bytes": full_cache_bytes(cache), "decode_evictions": events - events_before,
                "policy_ms_per_eviction": per_event_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--policies", default="full,h2o,learned(checkpoint='smollm2-135m-instruct')")
    parser.add_argument("--ratio", type=float, default=0.75, help="compression ratio (0.75: a 25%% budget)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per row")
    parser.add_argument("--evict-every", type=int, default=32, help="generated tokens between evictions")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    model, tokenizer = load(args.model, dtype=args.dtype)
    flags = cpu_flags()
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, avx512_bf16 {'yes' if 'avx512_bf16' in flags else 'no'}, "
          f"amx_bf16 {'yes' if 'amx_bf16' in flags else 'no'}, torch threads {torch.get_num_threads()}, dtype "
          f"{next(model.parameters()).dtype}; {args.model}, context {args.length}, ratio {args.ratio}, chunk "
          f"{args.chunk_size}, evict every {args.evict_every}, {args.tokens} generated tokens\n")
    print("| policy | batch | prefill s | decode tokens/s | peak cache MiB | full cache MiB | evictions while "
          "decoding | policy ms per eviction |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = contexts(tokenizer, args.length, batch)
        for spec in split_specs(args.policies):
            row = measure(model, spec, ids, args.ratio, args.chunk_size, args.tokens, args.evict_every)
            print(f"| {row['policy']} | {row['batch']} | {row['prefill_s']:.1f} | {row['tokens_per_s']:.1f} | "
                  f"{row['peak_bytes'] / 2**20:.1f} | {row['full_bytes'] / 2**20:.1f} | {row['decode_evictions']} | "
                  f"{row['policy_ms_per_eviction']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
