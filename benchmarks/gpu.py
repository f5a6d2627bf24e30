"""Does compression pay? Prefill, compression overhead, decode tokens/s beside the bandwidth limit, memory.

Run (one GPU):  python benchmarks/gpu.py                                   # Llama-3.1-8B-shaped, bf16, cuda
     (CPU):     python benchmarks/gpu.py --shape smollm2 --device cpu --dtype float32 --lengths 4096
     (smoke):   python benchmarks/gpu.py --shape tiny --device cpu --lengths 512 --tokens 4

A random-weight model of a real shape (no download; cost, not quality). For each context length, batch size
and cache, in one run so the ratios sit side by side:

* full: the whole cache;
* uniform: snapkv, every KV head keeping ``length * (1 - ratio)`` entries;
* global: snapkv's scores standardised per head and ranked across all layers and heads
  (``allocation="global"``): each head at its own length, stored ragged.

Printed per row: prefill seconds (CUDA-synchronised; compression included), compression ms and its share of
the prefill, decode tokens/s (all rows of the batch; the median of ``--tokens`` greedy steps timed one by
one, the caches of one context and batch decoded in turn), the bandwidth limit of one step (weights + cache
read once, at the copy bandwidth measured at start-up), the cache MiB after the prompt (entries held, and
allocated: with the room segments keep to grow in place and the rounding within a capacity bucket), and the
device's peak allocated memory over the row's prefill (CUDA).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import kvsieve
from kvsieve.engine.cache import cache_allocated_bytes, cache_bytes
from kvsieve.models import auto_dtype, resolve_dtype
from kvsieve.policies import FullCache, get
from kvsieve.selection import Selection

SHAPES = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, dtype: torch.dtype) -> float:
    """Bytes per second of a large device copy (read + write), the best of five."""
    n = (512 if device.type == "cuda" else 128) * 2**20 // torch.tensor([], dtype=dtype).element_size()
    a = torch.empty(n, dtype=dtype, device=device).fill_(1)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() * a.element_size() / best


def caches(ratios: list[float]):
    yield "full", FullCache(window=64), 0.0
    for ratio in ratios:
        yield "uniform", get("snapkv"), ratio
        spread = Selection(recent=64, allocation="global", normalization="zscore")
        yield "global", get("snapkv", selection=spread), ratio


@torch.no_grad()
def prefill(model, ids: torch.Tensor, policy, ratio: float, device: torch.device) -> dict:
    """The prompt's forward under ``policy`` (compression included), timed; the cache and the first token."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with kvsieve.attach(model, policy, ratio=ratio) as session:
        sync(device)
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync(device)
        prefill_s = time.perf_counter() - start
    compress_s = session.report.seconds if session.report is not None else 0.0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dict(cache=out.cache, token=out.logits[:, -1:].argmax(-1), prefill_s=prefill_s, compress_s=compress_s,
                cache_bytes=cache_bytes(out.cache), allocated_bytes=cache_allocated_bytes(out.cache),
                prefill_peak=peak, steps=[])


@torch.no_grad()
def decode_round_robin(model, rows: list[dict], tokens: int, device: torch.device) -> None:
    """``tokens`` greedy steps of every row's cache, one step of each in turn, each step timed alone: whatever else
    runs on a shared machine slows every row alike, and the median step shrugs off its spikes."""
    with kvsieve.attach(model, FullCache(window=64)):
        for step in range(tokens + 1):
            for r in rows:
                sync(device)
                start = time.perf_counter()
                r["token"] = model(input_ids=r["token"], cache=r["cache"], use_cache=True).logits[:, -1:].argmax(-1)
                sync(device)
                if step:  # the first step of each row is a warm-up (it also gives segments their room)
                    r["steps"].append(time.perf_counter() - start)


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where the device computes it), bfloat16, float32")
    parser.add_argument("--lengths", default="8192,32768,131072", help="context lengths, comma-separated")
    parser.add_argument("--ratios", default="0.5,0.875")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per row")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu")
    dtype = auto_dtype(device)[0] if args.dtype == "auto" else resolve_dtype(args.dtype)
    torch.set_flush_denormal(True)
    config = LlamaConfig(**SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, dtype)
    print(f"machine: {machine(device)}; torch {torch.__version__}; dtype {str(dtype).removeprefix('torch.')}; "
          f"{args.shape}-shaped random model ({weights / 2**30:.2f} GiB of weights); kvsieve {revision()}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.tokens} decode tokens per row\n")
    print("| context | batch | cache | ratio | prefill s | compress ms | compress % of prefill | decode tokens/s | "
          "bandwidth limit tokens/s | % of limit | cache MiB | allocated MiB | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            ids = torch.randint(1, config.vocab_size, (batch, length),
                                generator=torch.Generator().manual_seed(length)).to(device)
            rows = []
            for label, policy, ratio in caches([float(x) for x in args.ratios.split(",")]):
                try:
                    rows.append(dict(prefill(model, ids, policy, ratio, device), label=label, ratio=ratio))
                except torch.OutOfMemoryError:
                    print(f"| {length} | {batch} | {label} | {ratio} | out of memory |||||||||", flush=True)
            try:
                decode_round_robin(model, rows, args.tokens, device)
            except torch.OutOfMemoryError:
                print(f"| {length} | {batch} | decoding every cache together ran out of memory |", flush=True)
                continue
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            for r in rows:
                tokens_per_s = batch / statistics.median(r["steps"])
                limit = batch * bandwidth / (weights + r["cache_bytes"])  # one step reads weights + cache
                peak_text = "n/a" if peak is None else f"{r['prefill_peak'] / 2**30:.2f}"
                print(f"| {length} | {batch} | {r['label']} | {r['ratio']} | {r['prefill_s']:.2f} | "
                      f"{1000 * r['compress_s']:.1f} | {100 * r['compress_s'] / r['prefill_s']:.1f} | "
                      f"{tokens_per_s:.1f} | {limit:.0f} | {100 * tokens_per_s / limit:.0f} | "
                      f"{r['cache_bytes'] / 2**20:.1f} | {r['allocated_bytes'] / 2**20:.1f} | {peak_text} |",
                      flush=True)
            del rows

if __name__ == "__main__":
    main()
