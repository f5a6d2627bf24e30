"""Load on ``kvsieve serve``: N streamed chat requests at concurrency C on loopback, full KV vs a contract.

Starts the server in-process (one model load shared by both runs) on a random loopback port, sends RULER
niah prompts (``context + "\\n" + question``, the calibration layout) with the official openai client, and
prints throughput, latency p50/p95/p99, time to first token, peak RSS and KV-cache bytes per request.
Stops by itself after ``--requests`` requests per run.

    nice -n 10 env OMP_NUM_THREADS=1 python benchmarks/serve_load.py --contract contract.json \\
        --requests 24 --concurrency 4 --length 1024 --max-tokens 16
"""

from __future__ import annotations

import argparse
import platform
import resource
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import torch

from kvsieve.models import cpu_flags, load
from kvsieve.serve.command import build_state, point_source, serve
from kvsieve.tasks.ruler import generate as ruler_sample


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _one(client: openai.OpenAI, model: str, content: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, usage = None, None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                max_tokens=max_tokens, stream=True):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    return {"seconds": time.perf_counter() - start, "ttft": first if first is not None else float("nan"),
            "tokens": usage.completion_tokens, "kv": usage.kv_cache}


def run_load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: _one(client, model, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    lat = [r["seconds"] for r in results]
    ttft = [r["ttft"] for r in results]
    return {"requests": len(results), "wall": wall, "rps": len(results) / wall,
            "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "p50": _percentile(lat, 0.5), "p95": _percentile(lat, 0.95), "p99": _percentile(lat, 0.99),
            "ttft_p50": _percentile(ttft, 0.5), "ttft_p95": _percentile(ttft, 0.95),
            "bytes_full": statistics.mean(r["kv"]["bytes_full"] for r in results),
            "bytes_kept": statistics.mean(r["kv"]["bytes_kept"] for r in results),
            "points": sorted({f"{r['kv']['policy']}@{r['kv']['ratio']:g} ({r['kv']['status']})" for r in results}),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--contract", required=True, help="contract JSON (kvsieve certify) for the second run")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024, help="RULER prompt length in tokens")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be >= 1")

    model, tokenizer = load(args.model, args.dtype)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    prompts = []
    for seed in range(args.requests):
        sample = ruler_sample(args.task, args.length, seed, count, template_overhead=64)
        prompts.append(sample.context + "\n" + sample.question)
    print(f"machine: {_cpu_name()}, {torch.get_num_threads()} torch thread(s), "
          f"avx512_bf16={'avx512_bf16' in cpu_flags()}, amx_bf16={'amx_bf16' in cpu_flags()}, "
          f"dtype {next(model.parameters()).dtype}, torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"load: {args.requests} streamed chat requests per run, concurrency {args.concurrency}, "
          f"{args.task} at {args.length} tokens, max_tokens {args.max_tokens}, model {args.model}")
    rows = []
    for label, points in (("full KV", point_source(args.model)),
                          ("contract", point_source(args.model, contract=args.contract))):
        state = build_state(model, tokenizer, args.model, points, max_queue=max(16, args.requests),
                            max_tokens_limit=max(args.max_tokens, 1))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = serve(state)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            rows.append((label, run_load(f"http://127.0.0.1:{sock.getsockname()[1]}", args.model, prompts,
                                         args.concurrency, args.max_tokens)))
            print(f"{label}: {rows[-1][1]}", flush=True)  # kept if a later run is cut short
        finally:
            server.should_exit = True
            thread.join(120)
    print(f"\n| run | points | req/s | tok/s | p50 s | p95 s | p99 s | TTFT p50 s | TTFT p95 s | KV MiB full | "
          f"KV MiB kept | saved/request | peak RSS MiB |\n|{'---|' * 13}")
    for label, r in rows:
        print(f"| {label} | {', '.join(r['points'])} | {r['rps']:.2f} | {r['tokens_per_s']:.1f} | {r['p50']:.2f} | "
              f"{r['p95']:.2f} | {r['p99']:.2f} | {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} | "
              f"{r['bytes_full'] / 2**20:.2f} | {r['bytes_kept'] / 2**20:.2f} | "
              f"{(r['bytes_full'] - r['bytes_kept']) / 2**20:.2f} MiB | {r['peak_rss_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
