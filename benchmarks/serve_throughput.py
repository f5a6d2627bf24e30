"""Throughput and latency of ``kvsieve serve`` under one KV byte budget: N streaming clients, full KV vs compressed
points.

Two workloads, each with its own planted answer per client (a RULER needle, ``context + "\\n" + question``, the
calibration layout):

* ``retrieval``: a ``--length`` (1.5-2k) token needle prompt, ``--max-tokens`` (<= 32) new tokens;
* ``long``: a ~450-token needle prompt whose question asks for the number and then a long story, ``--long-tokens``
  (>= 256) new tokens: decode-bound work, where the bytes compression frees become more rows per decode step.

Configurations (``--configs``): ``full``, ``uniform@R`` and ``global@R`` (``--policy`` with that allocation at ratio
R; with ``--evict-every N`` > 0 the decode-time point ``SPEC@decodeNeN``: its prompt read N tokens at a time under
eviction and its rows evicted every N generated tokens, held at their budgets plus that room, as ``kvsieve eval
--mode decode`` runs it: ``serve/decode_prefill.py``; 0: prefill compression) and ``contract`` (``--contract``; its
points run as certified, a decode-time point ``SPEC@decodeCeE`` evicting while it decodes).
Every configuration of a workload runs under the same byte budget, ``--budget``
x N x the largest request's full-KV need (prompt + max_tokens): 0.25 of 8 clients is room for two at full KV. Each
configuration runs ``--repeats`` times, round robin (repeat 1 of every configuration, then repeat 2, ...), so a drift
in the machine's load falls on all of them alike. All N clients send at once and stream; each reply is checked for
its own planted answer.

Per run: tokens/s and requests/s (over the wall time of the run), p50 / p95 of time to first token and of the gaps
between two streamed chunks (a chunk is a token, unless the detokenizer held one back), the largest gap, the most KV
bytes the server allocated at once (the decode batch and the prefills in progress, after each step) and the most it
charged (never above the budget). The summary gives, per configuration, the mean and a 95% t-interval over the
repeats, and each point's tokens/s over full KV's in the same repeat (paired), with its interval. Before the runs it
times the two parts of a scheduler step alone: one prefill chunk and one decode step of N rows.

Resumable: every finished run is one line of ``--out`` (JSON); a rerun skips the runs already there and prints the
summary of all of them (``--summary-only`` prints it without running anything).

    python benchmarks/serve_throughput.py --workloads long --clients 16 --repeats 3 --budget 0.25 \\
        --configs uniform@0.875,global@0.875,full,uniform@0.5,global@0.5 --out results/serve/throughput-16.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import torch

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import stack_caches
from kvsieve.models import load
from kvsieve.policies.operating_point import OperatingPoint
from kvsieve.policy import FullCache
from kvsieve.serve.chat_prompt import chat_prompt
from kvsieve.serve.command import build_state, point_source, serve
from kvsieve.serve.decode_eviction import evict_rows, row_cap, stack_rows
from kvsieve.serve.decode_prefill import prefill_for
from kvsieve.serve.generation import Prefill, bytes_per_token
from kvsieve.serve.points import ChosenPoint
from kvsieve.serve.schemas import ChatMessage
from kvsieve.tasks.ruler import generate as ruler_sample

ROOT = Path(__file__).resolve().parent.parent
LONG_QUESTION = " First give the number. Then write a long, detailed story (at least 500 words) about that number."
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # t_{0.975, df}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    if os.environ.get("KVSIEVE_REVISION"):  # a run from a copy of the tree (no .git): the revision it was copied at
        return os.environ["KVSIEVE_REVISION"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "kvsieve", "benchmarks"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def percentile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95% t-interval (nan bounds for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


# -- workloads ---------------------------------------------------------------------------------------------------
def workload(name: str, tokenizer, clients: int, length: int) -> tuple[list[str], list[list[str]]]:
    """(prompts, planted answers): one needle sample per client, seeds 0..N-1."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    if name == "retrieval":
        samples = [ruler_sample("niah_single_1", length, seed, count, template_overhead=64) for seed in range(clients)]
        return [s.context + "\n" + s.question for s in samples], [s.answers for s in samples]
    if name == "long":
        samples = [ruler_sample("niah_single_1", 450, seed, count, template_overhead=64) for seed in range(clients)]
        return [s.context + "\n" + s.question + LONG_QUESTION for s in samples], [s.answers for s in samples]
    raise ValueError(f"unknown workload {name!r}: retrieval or long")


def points_for(config: str, args):
    if config == "full":
        return point_source(args.model)
    if config == "contract":
        if not args.contract:
            raise ValueError("the contract configuration needs --contract")
        return point_source(args.model, contract=args.contract)
    allocation, _, ratio = config.partition("@")
    policy = args.policy.format(model=args.model)
    spec = (policy[:-1] + f", allocation='{allocation}')" if policy.endswith(")")
            else f"{policy}(allocation='{allocation}')")
    return point_source(args.model, policy=spec, ratio=float(ratio), evict_every=args.evict_every)


# -- one run -----------------------------------------------------------------------------------------------------
def one_run(state, model_name: str, prompts: list[str], answers: list[list[str]], max_tokens: int) -> dict:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = serve(state)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"

    def client(i: int) -> dict:
        body = {"model": model_name, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": prompts[i]}]}
        start = time.perf_counter()
        times, text, usage = [], [], None
        with httpx.stream("POST", url, json=body, timeout=7200) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"client {i}: HTTP {reply.status_code}: {reply.read()[:300]!r}")
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise RuntimeError(f"client {i}: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        times.append(time.perf_counter())
                        text.append(piece)
        text = "".join(text)
        kv = usage["kv_cache"]
        return {"ttft": times[0] - start if times else math.nan, "gaps": [b - a for a, b in zip(times, times[1:])],
                "tokens": usage["completion_tokens"], "kept": kv["kept_fraction"],
                "point": f"{kv['point']} ({kv['status']})",  # spec, mode and ratio
                "right": any(a in text for a in answers[i]), "text": text[:80]}

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(client, range(len(prompts))))
        wall = time.perf_counter() - start
    finally:
        server.should_exit = True
        thread.join(120)
    scheduler = state.scheduler
    gaps = [g for r in results for g in r["gaps"]]
    ttft = [r["ttft"] for r in results]
    return {"wall": wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "requests_per_s": len(results) / wall,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95),
            "gap_p50": percentile(gaps, 0.5), "gap_p95": percentile(gaps, 0.95), "gap_max": max(gaps, default=math.nan),
            "tokens": sum(r["tokens"] for r in results), "rows_mean": scheduler.row_steps / max(1, scheduler.steps),
            "rows_peak": scheduler.peak_rows, "allocated_peak": scheduler.peak_allocated,
            "charged_peak": scheduler.peak_charged, "budget": scheduler.budget, "longest_step": scheduler.longest_step,
            "evictions": scheduler.evictions,
            "kept": statistics.fmean(r["kept"] for r in results), "right": sum(r["right"] for r in results),
            "n": len(results), "points": sorted({r["point"] for r in results}),
            "wrong": [r["text"] for r in results if not r["right"]]}


# -- the step's two parts alone ----------------------------------------------------------------------------------
@torch.no_grad()
def step_parts(model, tokenizer, prompt_text: str, chunk: int, rows: int, max_tokens: int) -> dict:
    """Seconds of the two parts of a step, each alone (the median of 3): a prefill chunk of ``chunk`` tokens, the
    first of this prompt and the last (which attends over the whole prompt: the dearest), and one decode step of
    ``rows`` rows at this prompt's length."""
    prompt = chat_prompt(tokenizer, [ChatMessage(role="user", content=prompt_text)])
    full = ChosenPoint(OperatingPoint.full("-", ""), "full")
    total = prompt.context_ids.shape[1] + prompt.question_ids.shape[1]
    first, last = [], []
    for _ in range(3):
        prefill = Prefill(model, prompt, full, max_tokens)
        start = time.perf_counter()
        prefill.advance(chunk)
        first.append(time.perf_counter() - start)
        prefill = Prefill(model, prompt, full, max_tokens)
        if total > chunk:
            prefill.advance(total - chunk)
        start = time.perf_counter()
        prefill.advance(chunk)
        last.append(time.perf_counter() - start)
    prefill = Prefill(model, prompt, full, max_tokens)
    while not prefill.done:
        prefill.advance(4096)
    cache, logits, info = prefill.finished()
    batch = stack_caches([cache] * rows)
    steps = []
    ids = logits.argmax()[None, None].expand(rows, 1)
    positions = torch.full((rows, 1), info.prompt_tokens)
    for i in range(3):
        start = time.perf_counter()
        with attach(model, FullCache()):
            model(input_ids=ids, cache=batch, use_cache=True, position_ids=positions + i)
        steps.append(time.perf_counter() - start)
    return {"prefill_chunk_s": statistics.median(first), "last_chunk_s": statistics.median(last),
            "decode_step_s": statistics.median(steps), "chunk": chunk, "rows": rows,
            "prompt_tokens": info.prompt_tokens}


@torch.no_grad()
def eviction_part(model, tokenizer, prompt_text: str, points, rows: int, max_tokens: int) -> dict:
    """Seconds of one eviction of ``rows`` rows at ``points``' point, each having taken ``evict_every`` tokens (the
    median of 3): what a step that evicts adds to its decode step (``serve/decode_eviction.evict_rows``: every row
    taken out, scored, laid out again, the batch stacked again), and one decode step of those rows at their cap."""
    prompt = chat_prompt(tokenizer, [ChatMessage(role="user", content=prompt_text)])
    chosen = points.base(None, prompt.context_ids.shape[1])
    prefill = prefill_for(model, prompt, chosen, max_tokens)
    while not prefill.done:
        prefill.advance(4096)
    cache, logits, info = prefill.finished()
    cap = row_cap(cache, chosen.point.policy, prefill.room)
    batch = None
    for _ in range(rows):
        batch = stack_rows(batch, cache)
    ids = logits.argmax()[None, None].expand(rows, 1)
    position = info.prompt_tokens
    steps, evictions = [], []
    for _ in range(3):
        for _ in range(prefill.room):  # fill the room: the rows are due
            start = time.perf_counter()
            with attach(model, FullCache()):
                model(input_ids=ids, cache=batch, use_cache=True, position_ids=torch.full((rows, 1), position))
            steps.append(time.perf_counter() - start)
            position += 1
        start = time.perf_counter()
        batch, _, failed = evict_rows(batch, [(chosen.point.policy, cap)] * rows, [position] * rows,
                                   [prefill.room] * rows)
        evictions.append(time.perf_counter() - start)
        if failed:
            raise RuntimeError(f"evictions failed: {failed}")
    return {"eviction_s": statistics.median(evictions), "capped_decode_step_s": statistics.median(steps),
            "rows": rows, "room": prefill.room, "point": str(chosen.setting), "cap_bytes": cap.charge}


# -- the summary -------------------------------------------------------------------------------------------------
def _fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    mean, low, high = interval([v * scale for v in values])
    if math.isnan(low):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def summary(lines: list[dict]) -> str:
    out = []
    for name in dict.fromkeys(line["workload"] for line in lines if line.get("kind") == "run"):
        runs = [line for line in lines if line.get("kind") == "run" and line["workload"] == name]
        parts = [line for line in lines if line.get("kind") == "parts" and line["workload"] == name]
        head = runs[0]
        out.append(f"\n### {name}: {head['clients']} clients, {head['prompt_tokens']} prompt tokens, max_tokens "
                   f"{head['max_tokens']}, budget {head['result']['budget'] / 2**20:.1f} MiB, prefill chunk "
                   f"{head['prefill_chunk']}\n")
        out.append(f"machine: {head['machine']}\n")
        if parts:
            p = parts[-1]["parts"]
            dearest = p.get("last_chunk_s", p["prefill_chunk_s"])
            last = f", the prompt's last {dearest:.3f} s" if "last_chunk_s" in p else ""
            out.append(f"step parts alone ({len(parts)} measurement(s), the last shown): one prefill chunk of "
                       f"{p['chunk']} tokens, the prompt's first {p['prefill_chunk_s']:.3f} s{last}; one decode step "
                       f"of {p['rows']} rows at {p['prompt_tokens']} tokens {p['decode_step_s']:.3f} s (one step at "
                       f"most {dearest + p['decode_step_s']:.3f} s)\n")
        for line in [x for x in lines if x.get("kind") == "eviction" and x["workload"] == name]:
            e = line["part"]
            out.append(f"one eviction alone at {line['config']} ({e['point']}): {e['rows']} rows, each having taken "
                       f"{e['room']} tokens, {e['eviction_s']:.3f} s; one decode step of those rows at their cap "
                       f"{e['capped_decode_step_s']:.3f} s (a row's cap {e['cap_bytes'] / 2**20:.2f} MiB)\n")
        out.append("| config | point | runs | tok/s | vs full (paired) | req/s | TTFT p50 s | TTFT p95 s | gap p50 s | "
                   "gap p95 s | gap max s | rows mean / peak | KV kept | allocated peak MiB | charged peak MiB | "
                   "planted answer |")
        out.append("|" + "---|" * 16)
        full = {line["repeat"]: line["result"]["tokens_per_s"] for line in runs if line["config"] == "full"}
        for config in dict.fromkeys(line["config"] for line in runs):
            rs = [line for line in runs if line["config"] == config]
            r = [line["result"] for line in rs]
            paired = [line["result"]["tokens_per_s"] / full[line["repeat"]] for line in rs if line["repeat"] in full]
            vs = _fmt(paired) + "x" if paired and config != "full" else "-"
            out.append(
                f"| {config} | {', '.join(r[0]['points'])} | {len(r)} | {_fmt([x['tokens_per_s'] for x in r])} | "
                f"{vs} | "
                f"{_fmt([x['requests_per_s'] for x in r], digits=3)} | {_fmt([x['ttft_p50'] for x in r], digits=1)} | "
                f"{_fmt([x['ttft_p95'] for x in r], digits=1)} | {_fmt([x['gap_p50'] for x in r], digits=3)} | "
                f"{_fmt([x['gap_p95'] for x in r], digits=3)} | {_fmt([x['gap_max'] for x in r], digits=2)} | "
                f"{statistics.fmean(x['rows_mean'] for x in r):.1f} / {max(x['rows_peak'] for x in r)} | "
                f"{statistics.fmean(x['kept'] for x in r):.3f} | "
                f"{_fmt([x['allocated_peak'] for x in r], 2**-20, 1)} | "
                f"{max(x['charged_peak'] for x in r) / 2**20:.1f} | "
                f"{sum(x['right'] for x in r)}/{sum(x['n'] for x in r)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workloads", default="retrieval,long")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients, one request each (N)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--length", type=int, default=1792, help="retrieval prompt length in tokens")
    parser.add_argument("--max-tokens", type=int, default=32, help="retrieval: new tokens at most")
    parser.add_argument("--long-tokens", type=int, default=256, help="long: new tokens at most")
    parser.add_argument("--budget", type=float, default=0.25,
                        help="the KV byte budget, as a share of N x the largest request's need at full KV")
    parser.add_argument("--policy", default="kvzap(checkpoint='{model}')",
                        help="the policy of uniform@R and global@R ({model}: --model)")
    parser.add_argument("--configs", default="full,uniform@0.5,uniform@0.875,global@0.5,global@0.875,contract")
    parser.add_argument("--contract", help="a contract (kvsieve certify) for the contract configuration")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--evict-every", type=int, default=32,
                        help="uniform@R and global@R run the decode-time point SPEC@decodeNeN, evicting every N "
                             "tokens, read or generated (0: prefill compression)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default="results/serve/throughput.jsonl", help="one JSON line per finished run")
    parser.add_argument("--summary-only", action="store_true", help="print the summary of --out and exit")
    parser.add_argument("--parts", action="store_true",
                        help="time the step's two parts alone again (a new line in --out) even if --out has them")
    parser.add_argument("--parts-only", action="store_true", help="only time the step's parts, run nothing")
    parser.add_argument("--eviction-only", metavar="CONFIG",
                        help="only time one eviction of N rows at CONFIG (uniform@R or global@R) and a decode step of "
                             "those rows at their cap (a new line in --out), run nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    if args.summary_only:
        print(summary(lines))
        return 0
    if args.clients < 1 or not 0 < args.budget <= 1 or args.repeats < 1:
        parser.error("--clients and --repeats must be >= 1 and --budget in (0, 1]")
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.dtype)
    machine = (f"{cpu_name()}, {torch.get_num_threads()} torch thread(s), {next(model.parameters()).dtype}, "
               f"torch {torch.__version__}, git {git_revision()}")
    print(f"machine: {machine}", flush=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        prompts, answers = workload(name, tokenizer, args.clients, args.length)
        max_tokens = args.max_tokens if name == "retrieval" else args.long_tokens
        tokens = [sum(t.shape[1] for t in (p.context_ids, p.question_ids)) for p in
                  (chat_prompt(tokenizer, [ChatMessage(role="user", content=text)]) for text in prompts)]
        budget = int(args.budget * args.clients * bytes_per_token(model) * (max(tokens) + max_tokens))
        key = dict(workload=name, clients=args.clients, prompt_tokens=f"{min(tokens)}-{max(tokens)}",
                   max_tokens=max_tokens, budget_share=args.budget, prefill_chunk=args.prefill_chunk,
                   evict_every=args.evict_every)
        if args.eviction_only:
            part = eviction_part(model, tokenizer, prompts[0], points_for(args.eviction_only, args), args.clients,
                                 max_tokens)
            lines.append(dict(key, kind="eviction", config=args.eviction_only, part=part, machine=machine))
            with out.open("a") as f:
                f.write(json.dumps(lines[-1]) + "\n")
            print(f"{name}: one eviction alone {part}", flush=True)
            continue
        measured = any(line.get("kind") == "parts" and line["workload"] == name for line in lines)
        if args.parts or args.parts_only or not measured:
            parts = step_parts(model, tokenizer, prompts[0], args.prefill_chunk, args.clients, max_tokens)
            lines.append(dict(key, kind="parts", parts=parts, machine=machine))
            with out.open("a") as f:
                f.write(json.dumps(lines[-1]) + "\n")
            print(f"{name}: step parts alone {parts}", flush=True)
        for repeat in range(0 if args.parts_only else args.repeats):
            for config in configs:
                done = [line for line in lines if line.get("kind") == "run" and line["config"] == config
                        and line["repeat"] == repeat and all(line[k] == v for k, v in key.items())]
                if done:
                    continue
                state = build_state(model, tokenizer, args.model, points_for(config, args), max_queue=args.clients,
                                    max_tokens_limit=max_tokens, kv_budget=budget, prefill_chunk=args.prefill_chunk)
                result = one_run(state, args.model, prompts, answers, max_tokens)
                lines.append(dict(key, kind="run", config=config, repeat=repeat, result=result, machine=machine))
                with out.open("a") as f:
                    f.write(json.dumps(lines[-1]) + "\n")
                print(f"{name} {config} #{repeat}: {json.dumps(result)}", flush=True)
    print(summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
