"""Throughput of ``kvsieve serve`` under one KV byte budget: N concurrent clients, full KV vs compressed points.

Every run serves the same N RULER needle prompts (``context + "\\n" + question``, the calibration layout, one
planted answer each) to N concurrent clients (the official openai client), under the same byte budget: a
share (``--budget``) of what N of the largest requests need at full KV (prompt + max_tokens). A point that keeps fewer
bytes admits more requests into the decode batch. Runs: full KV, ``--policy`` with uniform and global
allocation at each ``--ratios``, and ``--contract`` when given. Each reply is checked for its own planted
answer. Prints a markdown table with the machine and the git revision.

    nice -n 10 python benchmarks/serve_throughput.py --clients 8 --length 2048 --max-tokens 64 \\
        --budget 0.25 --threads 1 --contract contract.json
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch

from kvsieve.models import load
from kvsieve.serve.chat_prompt import chat_prompt
from kvsieve.serve.command import build_state, point_source, serve
from kvsieve.serve.generation import bytes_per_token
from kvsieve.serve.schemas import ChatMessage
from kvsieve.tasks.ruler import generate as ruler_sample

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class PeakRSS:
    """The largest resident set of this process while the block runs (sampled every 50 ms)."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)
            self._stop.wait(0.05)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()


def run(state, model_name: str, prompts: list[str], answers: list[list[str]], max_tokens: int) -> dict:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = serve(state)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="unused",
                           max_retries=0, timeout=3600)

    def one(i: int) -> dict:
        start = time.perf_counter()
        reply = client.chat.completions.create(model=model_name, max_tokens=max_tokens,
                                               messages=[{"role": "user", "content": prompts[i]}])
        text = reply.choices[0].message.content
        return {"seconds": time.perf_counter() - start, "tokens": reply.usage.completion_tokens,
                "kv": reply.usage.kv_cache, "right": any(a in text for a in answers[i]), "text": text}

    try:
        with PeakRSS() as rss:
            start = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(pool.map(one, range(len(prompts))))
            wall = time.perf_counter() - start
    finally:
        server.should_exit = True
        thread.join(120)
    scheduler = state.scheduler
    lat = [r["seconds"] for r in results]
    return {"wall": wall, "rps": len(results) / wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "p50": percentile(lat, 0.5), "p95": percentile(lat, 0.95),
            "rows_mean": scheduler.row_steps / max(1, scheduler.steps), "rows_peak": scheduler.peak_rows,
            "admitted_peak": scheduler.peak_charged, "rss_peak": rss.peak,
            "kept": statistics.mean(r["kv"]["bytes_kept"] / r["kv"]["bytes_full"] for r in results),
            "right": sum(r["right"] for r in results), "n": len(results),
            "points": sorted({f"{r['kv']['policy']}@{r['kv']['ratio']:g} ({r['kv']['status']})" for r in results}),
            "wrong": [r["text"][:60] for r in results if not r["right"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients, one request each (N)")
    parser.add_argument("--length", type=int, default=2048, help="RULER prompt length in tokens (L)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.25,
                        help="the KV byte budget, as a share of N x the largest request's need at full KV")
    parser.add_argument("--policy", default="kvzap(checkpoint='{model}')",
                        help="policy run with allocation='uniform' and 'global' ({model}: --model)")
    parser.add_argument("--ratios", default="0.5,0.875")
    parser.add_argument("--contract", help="a contract (kvsieve certify) for one more run")
    parser.add_argument("--runs", default="full,uniform,global,contract", help="which runs, comma-separated")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    if args.clients < 1 or not 0 < args.budget <= 1:
        parser.error("--clients must be >= 1 and --budget in (0, 1]")
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.dtype)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    samples = [ruler_sample(args.task, args.length, seed, count, template_overhead=64) for seed in range(args.clients)]
    prompts = [s.context + "\n" + s.question for s in samples]
    tokens = [sum(t.shape[1] for t in (p.context_ids, p.question_ids)) for p in
              (chat_prompt(tokenizer, [ChatMessage(role="user", content=text)]) for text in prompts)]
    # room for budget x N of the largest requests at full KV (25% of 8 clients: two of them)
    full_need = args.clients * bytes_per_token(model) * (max(tokens) + args.max_tokens)
    budget = int(args.budget * full_need)
    runs = [r.strip() for r in args.runs.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    policy = args.policy.format(model=args.model)
    plan = [("full KV", point_source(args.model))] if "full" in runs else []
    for allocation in ("uniform", "global"):
        if allocation in runs:
            spec = policy[:-1] + f", allocation='{allocation}')" if policy.endswith(")") else \
                f"{policy}(allocation='{allocation}')"
            plan += [(f"{allocation} @ {r:g}", point_source(args.model, policy=spec, ratio=r)) for r in ratios]
    if args.contract and "contract" in runs:
        plan.append(("contract", point_source(args.model, contract=args.contract)))
    machine = (f"{cpu_name()}, {torch.get_num_threads()} torch thread(s), {next(model.parameters()).dtype}, "
               f"torch {torch.__version__}, git {git_revision()}")
    print(f"machine: {machine}")
    print(f"load: {args.clients} concurrent clients x 1 chat request, {args.task} at {args.length} tokens "
          f"({min(tokens)}-{max(tokens)} prompt tokens), max_tokens {args.max_tokens}, model {args.model}; KV budget "
          f"{budget / 2**20:.1f} MiB = {args.budget:g} x {full_need / 2**20:.1f} MiB ({args.clients} x the largest "
          "request at full KV)",
          flush=True)
    rows = []
    for label, points in plan:
        state = build_state(model, tokenizer, args.model, points, max_queue=args.clients,
                            max_tokens_limit=args.max_tokens, kv_budget=budget)
        rows.append((label, run(state, args.model, prompts, [s.answers for s in samples], args.max_tokens)))
        print(f"{label}: {rows[-1][1]}", flush=True)  # kept if a later run is cut short
    base = next((r["tokens_per_s"] for label, r in rows if label == "full KV"), None)
    print(f"\n| run | point | in flight, mean / peak | tok/s | vs full | req/s | p50 s | p95 s | KV kept | "
          f"admitted peak MiB | peak RSS MiB | planted answer |\n|{'---|' * 12}")
    for label, r in rows:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| {label} | {', '.join(r['points'])} | {r['rows_mean']:.1f} / {r['rows_peak']} | "
              f"{r['tokens_per_s']:.2f} | {ratio} | {r['rps']:.3f} | {r['p50']:.1f} | {r['p95']:.1f} | "
              f"{r['kept']:.3f} | {r['admitted_peak'] / 2**20:.1f} | {r['rss_peak'] / 2**20:.0f} | "
              f"{r['right']}/{r['n']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
