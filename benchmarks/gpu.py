"""GPU readiness: prefill, compression overhead, decode tokens/s and peak memory on a Llama-3.1-8B-shaped model.

Run (one GPU):  python benchmarks/gpu.py                      # 8k and 32k, bf16, cuda
     (any CPU): python benchmarks/gpu.py --tiny               # a tiny model, short contexts, float32, cpu

A model of Llama-3.1-8B's shape (32 layers, 32 query / 8 KV heads of 128, hidden 4096, MLP 14336,
vocab 128256; random weights, so no download) in bf16 on ``--device``. For each context length and cache:

* full: the whole cache (``ratio=0``);
* uniform: snapkv, every KV head keeping ``length * (1 - ratio)`` entries;
* ragged-global: snapkv under ``Selection(allocation="global", normalization="zscore")``: the model's
  entries shared by every layer and head, stored ragged (each head at its own length);

at ratios --ratios (default 0.5 and 0.875). Printed per row: prefill seconds (the prompt's forward,
compression included), compression ms (scores, selection, gather) and its share of the prefill, decode
tokens/s over --tokens greedy steps (batch 1), the cache's bytes, and ``torch.cuda.max_memory_allocated``
over the row (reset before it; on the CPU: n/a). Random weights attend much like real ones for timing
purposes, not for quality: this measures cost only.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import kvsieve
from kvsieve.engine.cache import cache_bytes
from kvsieve.policies import FullCache, get
from kvsieve.selection import Selection

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def caches(ratios: list[float]):
    yield "full", FullCache(window=64), 0.0
    for ratio in ratios:
        yield "uniform", get("snapkv"), ratio
        yield "ragged-global", get("snapkv", selection=Selection(recent=64, allocation="global",
                                                                  normalization="zscore")), ratio


@torch.no_grad()
def row(model, ids: torch.Tensor, policy, ratio: float, tokens: int, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with kvsieve.attach(model, policy, ratio=ratio) as session:
        sync(device)
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync(device)
        prefill_s = time.perf_counter() - start
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        del out
        token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)  # warm-up
        sync(device)
        start = time.perf_counter()
        for _ in range(tokens):
            token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        sync(device)
        decode_s = time.perf_counter() - start
        compress_s = session.report.seconds if session.report is not None else 0.0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dict(prefill_s=prefill_s, compress_ms=1000 * compress_s, tokens_per_s=tokens / decode_s,
                cache_mib=cache_bytes(cache) / 2**20, peak_gib=None if peak is None else peak / 2**30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU in float32 (a smoke run)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    parser.add_argument("--lengths", default=None, help="context lengths (default 8192,32768; --tiny 1024)")
    parser.add_argument("--ratios", default="0.5,0.875")
    parser.add_argument("--tokens", type=int, default=None, help="decode steps (default 64; --tiny 8)")
    args = parser.parse_args()
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --tiny (CPU smoke run) or on a machine with a GPU")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    lengths = [int(x) for x in (args.lengths or ("1024" if args.tiny else "8192,32768")).split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    tokens = args.tokens or (8 if args.tiny else 64)
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY if args.tiny else LLAMA_8B))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", torch_dtype=dtype).eval()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, dtype {dtype}, "
          f"{'tiny' if args.tiny else 'Llama-3.1-8B'}-shaped random model, {tokens} decode tokens, batch 1\n")
    print("| context | cache | ratio | prefill s | compress ms | compress % of prefill | decode tokens/s | "
          "cache MiB | max allocated GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in lengths:
        ids = torch.randint(1, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        ids = ids.to(device)
        for label, policy, ratio in caches(ratios):
            r = row(model, ids, policy, ratio, tokens, device)
            share = 100 * r["compress_ms"] / 1000 / r["prefill_s"]
            peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            print(f"| {length} | {label} | {ratio} | {r['prefill_s']:.2f} | {r['compress_ms']:.1f} | {share:.1f} | "
                  f"{r['tokens_per_s']:.1f} | {r['cache_mib']:.1f} | {peak} |", flush=True)


if __name__ == "__main__":
    main()
