"""Ragged vs uniform caches at the same total entries: decode tokens/s and prefill-compression time.

Run: OMP_NUM_THREADS=1 nice -n 10 python benchmarks/ragged_speed.py --length 2048 --ratio 0.75 --tokens 32

A random-weight model of SmolLM2-135M's shape (Llama, 30 layers, 9 query / 3 KV heads of 64, hidden
576; ``--shape qwen`` for Qwen2.5-0.5B's 24 layers, 14 / 2 heads) reads ``--length`` random tokens
once under the full cache; then, on copies of that cache:

* uniform: snapkv, every head of every layer keeps ``k = length * (1 - ratio)`` entries (dense);
* ragged-layer: adakv (``allocation="layer"``): each layer's ``h * k`` entries shared by its heads;
* ragged-global: snapkv with ``Selection(allocation="global", normalization="zscore")``: the model's
  ``L * h * k`` entries shared by every layer and head.

All three hold the same number of entries (checked), so any difference in decode speed is the cost of
per-head storage (one attention call per KV head instead of one per layer). Printed per cache: the
compression time (scores, selection, gather; median of --repeats), decode tokens/s over --tokens
greedy steps (batch 1), entries and bytes held. Quote the machine with the figures.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

import kvsieve
from kvsieve.engine.cache import cache_bytes, sieve_layers
from kvsieve.engine.compress import compress_cache
from kvsieve.policies import FullCache, get
from kvsieve.selection import Budget, Selection

SHAPES = {
    "smollm2": (LlamaConfig, dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)),
    "qwen": (Qwen2Config, dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)),
}


def clone(cache):
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    config_class, params = SHAPES[args.shape]
    model = AutoModelForCausalLM.from_config(config_class(**params, max_position_embeddings=32768),
                                             attn_implementation="sdpa").eval()
    ids = torch.randint(1, params["vocab_size"], (1, args.length), generator=torch.Generator().manual_seed(0))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, float32, random {args.shape}-shaped model, context {args.length}, ratio "
          f"{args.ratio}, {args.tokens} decode tokens, batch 1\n")
    policies = {
        "uniform (snapkv)": get("snapkv"),
        "ragged-layer (adakv)": get("adakv"),
        "ragged-global (snapkv, zscore)": get("snapkv", selection=Selection(recent=64, allocation="global",
                                                                              normalization="zscore")),
    }
    capture = FullCache(window=64)
    with torch.no_grad(), kvsieve.attach(model, capture, ratio=0.0):
        full = model(input_ids=ids, use_cache=True, logits_to_keep=1).cache
        print("| cache | compress ms | decode tokens/s | entries held | MiB held | ragged layers |")
        print("|---|---|---|---|---|---|")
        for label, policy in policies.items():
            times = []
            for _ in range(args.repeats):
                cache = clone(full)
                start = time.perf_counter()
                compress_cache(cache, policy, Budget(ratio=args.ratio))
                times.append(time.perf_counter() - start)
            layers = sieve_layers(cache)
            entries = sum(sum(layer.head_lengths) for _, layer in layers)
            held = cache_bytes(cache)  # before decoding adds its tokens
            token = torch.tensor([[1]])
            model(input_ids=token, cache=cache, use_cache=True)  # warm-up step
            start = time.perf_counter()
            for _ in range(args.tokens):
                token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            rate = args.tokens / (time.perf_counter() - start)
            print(f"| {label} | {1000 * statistics.median(times):.0f} | {rate:.1f} | {entries} | "
                  f"{held / 2**20:.1f} | {sum(layer.is_ragged for _, layer in layers)} |", flush=True)


if __name__ == "__main__":
    main()
