"""Document QA through ``kvsieve serve``: many questions about a few documents, where the context cache pays.

The workload (issue 70's multi-question target): ``--documents`` RULER niah_multikey_1 documents of 2-4k tokens
(length drawn per document, seeded), each holding four needles ("One of the special magic numbers for KEY is: N.");
each document gets ``--questions`` questions, one per needle, each with its own planted answer. All the requests are
shuffled (``--seed``) across documents and sent by ``--clients`` streaming clients, each sending its next request when
its last is answered. A reply is right when it holds its needle's number.

Configurations (``--configs``), every one with the server's context cache on (a full-KV server's is prefix caching):

* ``full``: full KV, a KV budget with room for ``--room`` documents at full KV (the largest prompt + max_tokens);
* ``recall``: ``--policy`` at ``--ratio`` with ``--recall`` (the hot tier in the same KV budget as full's, the cold
  tiers in a ``--cold-budget`` large enough for every document's);
* ``recall-total``: the same point with the cold tier as ``--total-cold`` (int4 by default), the KV budget and the
  cold budget splitting full's KV budget (``--total-split`` of it cold): equal *total* bytes;
* ``full-fits`` / ``recall-fits``: both with room for every document at full KV plus ``--room`` requests.

Each configuration runs ``--repeats`` times round robin (repeat 1 of each, then repeat 2, ...) so drifts in the
machine's load fall on all alike; a fresh server (empty context cache) each run. Per run: requests/s over the wall
time, p50 / p95 time to first token, right answers, the context cache's hits, misses and evictions. The summary gives
means with 95% t-intervals over repeats, and requests/s over full's of the same regime, paired by repeat.

Resumable: each finished run is one JSON line of ``--out``; a rerun skips those and prints the summary of all.

    python benchmarks/serve_documents.py --repeats 3 --out results/serve/documents.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import random
import re
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import torch
from serve_throughput import interval, percentile

from kvsieve.harness.provenance import current
from kvsieve.models import load
from kvsieve.serve.chat_prompt import chat_prompt
from kvsieve.serve.command import build_state, point_source, serve
from kvsieve.serve.generation import bytes_per_token
from kvsieve.serve.schemas import ChatMessage
from kvsieve.tasks.ruler import generate as ruler_sample

NEEDLE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")
REGIMES = {"full": "tight", "recall": "tight", "recall-total": "tight", "full-fits": "fits", "recall-fits": "fits"}


@dataclass(frozen=True)
class Request:
    document: int
    text: str
    answer: str


def workload(tokenizer, documents: int, questions: int, seed: int) -> list[Request]:
    """Every (document, question) request, shuffled across documents by ``seed``."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    rng = random.Random(seed)
    requests = []
    for d in range(documents):
        sample = ruler_sample("niah_multikey_1", rng.randint(2048, 4096), seed * 1000 + d, count, template_overhead=64)
        needles = NEEDLE.findall(sample.context)
        if len(needles) < questions:
            raise ValueError(f"document {d} holds {len(needles)} needles; --questions {questions} needs as many")
        asked_key = next(k for k, _ in needles if k in sample.question)
        for key, value in needles[:questions]:
            requests.append(Request(d, sample.context + "\n" + sample.question.replace(asked_key, key), value))
    rng.shuffle(requests)
    return requests


def one_run(state, model_name: str, requests: list[Request], clients: int, max_tokens: int) -> dict:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = serve(state)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
    todo: queue.Queue[Request] = queue.Queue()
    for request in requests:
        todo.put(request)

    def ask(request: Request) -> dict:
        body = {"model": model_name, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": request.text}]}
        start = time.perf_counter()
        first, text, usage = None, [], None
        with httpx.stream("POST", url, json=body, timeout=7200) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {reply.read()[:300]!r}")
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"]))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
        answer = "".join(text)
        return {"ttft": (first or math.nan) - start, "right": request.answer in answer,
                "hit": usage["kv_cache"]["context_cache"] == "hit", "kept": usage["kv_cache"]["kept_fraction"],
                "point": usage["kv_cache"]["policy"], "text": answer[:60]}

    def client() -> list[dict]:
        done = []
        while True:
            try:
                request = todo.get_nowait()
            except queue.Empty:
                return done
            done.append(ask(request))

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = [r for rs in pool.map(lambda _: client(), range(clients)) for r in rs]
        wall = time.perf_counter() - start
    finally:
        server.should_exit = True
        thread.join(120)
    s, metrics = state.scheduler, state.metrics
    ttft = [r["ttft"] for r in results]
    return {"wall": wall, "requests_per_s": len(results) / wall, "n": len(results),
            "right": sum(r["right"] for r in results), "hits": sum(r["hit"] for r in results),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95),
            "evictions": metrics.value("kvsieve_context_cache_evictions_total"),
            "kept": statistics.fmean(r["kept"] for r in results), "budget": s.budget,
            "cold_budget": s.contexts.cold_budget, "charged_peak": s.peak_charged, "allocated_peak": s.peak_allocated,
            "points": sorted({r["point"] for r in results}), "prefill_s": s.prefill_seconds,
            "decode_s": s.decode_seconds,
            "wrong": [r["text"] for r in results if not r["right"]][:8]}


def _fmt(values: list[float], digits: int = 2) -> str:
    mean, low, high = interval(values)
    return f"{mean:.{digits}f}" if math.isnan(low) else f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def summary(lines: list[dict]) -> str:
    runs = [line for line in lines if line.get("kind") == "run"]
    if not runs:
        return "no runs yet"
    head = runs[0]
    out = [f"{head['documents']} documents x {head['questions']} questions, {head['clients']} clients, max_tokens "
           f"{head['max_tokens']}, prompts {head['prompt_tokens']} tokens; {head['machine']}", "",
           "| config | point | runs | req/s | vs full, paired | right | context hits | TTFT p50 s | TTFT p95 s | "
           "KV budget MiB | cold budget MiB | charged peak MiB |", "|" + "---|" * 12]
    for config in dict.fromkeys(line["config"] for line in runs):
        rs = [line for line in runs if line["config"] == config]
        base = "full" if REGIMES[config] == "tight" else "full-fits"
        full = {line["repeat"]: line["result"]["requests_per_s"] for line in runs if line["config"] == base}
        paired = [line["result"]["requests_per_s"] / full[line["repeat"]] for line in rs if line["repeat"] in full]
        r = [line["result"] for line in rs]
        out.append(f"| {config} | {', '.join(r[0]['points'])} | {len(r)} | "
                   f"{_fmt([x['requests_per_s'] for x in r], 3)} | "
                   f"{_fmt(paired) + 'x' if paired and config != base else '-'} | "
                   f"{sum(x['right'] for x in r)}/{sum(x['n'] for x in r)} | "
                   f"{sum(x['hits'] for x in r)}/{sum(x['n'] for x in r)} | {_fmt([x['ttft_p50'] for x in r], 1)} | "
                   f"{_fmt([x['ttft_p95'] for x in r], 1)} | {r[0]['budget'] / 2**20:.0f} | "
                   f"{r[0]['cold_budget'] / 2**20:.0f} | {max(x['charged_peak'] for x in r) / 2**20:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--questions", type=int, default=4, help="questions a document (at most its 4 needles)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--room", type=int, default=4, help="documents at full KV the tight KV budget holds")
    parser.add_argument("--policy", default="kvzap(checkpoint='{model}')", help="{model}: --model")
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument("--recall", default="recall(fraction=0.025, chunk=48, pool='span')",
                        help="the dev rule's setting (docs/recall.md), fixed before this benchmark ran")
    parser.add_argument("--total-cold", default="int4", help="the cold format of recall-total")
    parser.add_argument("--total-split", type=float, default=0.5, help="recall-total: the share of bytes held cold")
    parser.add_argument("--configs", default="full,recall,recall-total")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/serve/documents.jsonl", help="one JSON line per finished run")
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    if args.summary_only:
        print(summary(lines))
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in REGIMES]
    if unknown:
        parser.error(f"unknown configs {unknown}: choose from {', '.join(REGIMES)}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.dtype)
    provenance = current(args.dtype)
    machine = (f"{provenance['machine']}, {provenance['threads']} thread(s), {args.dtype}, "
               f"git {(provenance['commit'] or '?')[:7]}{'+dirty' if provenance['dirty'] else ''}")
    requests = workload(tokenizer, args.documents, args.questions, args.seed)
    tokens = [sum(t.shape[1] for t in (p.context_ids, p.question_ids)) for p in
              (chat_prompt(tokenizer, [ChatMessage(role="user", content=r.text)]) for r in requests)]
    per_document = bytes_per_token(model) * (max(tokens) + args.max_tokens)
    key = dict(documents=args.documents, questions=args.questions, clients=args.clients, seed=args.seed,
               max_tokens=args.max_tokens, room=args.room, prompt_tokens=f"{min(tokens)}-{max(tokens)}")
    policy = args.policy.format(model=args.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{machine}; {len(requests)} requests, prompts {key['prompt_tokens']} tokens", flush=True)
    for repeat in range(args.repeats):
        for config in configs:
            if any(line.get("kind") == "run" and line["config"] == config and line["repeat"] == repeat
                   and all(line[k] == v for k, v in key.items()) for line in lines):
                continue
            tight = per_document * args.room
            budget = tight if REGIMES[config] == "tight" else per_document * (args.documents + args.room)
            cold = per_document * args.documents  # every document's cold tier
            recall = args.recall
            if config == "recall-total":
                cold = int(tight * args.total_split)
                budget = tight - cold
                recall = recall[:-1] + f", cold='{args.total_cold}')"
            points = (point_source(args.model) if config.startswith("full")
                      else point_source(args.model, policy=policy, ratio=args.ratio, recall=recall, evict_every=0))
            state = build_state(model, tokenizer, args.model, points, max_queue=len(requests),
                                max_tokens_limit=args.max_tokens, kv_budget=budget, prefill_chunk=args.prefill_chunk,
                                cold_budget=cold)
            result = one_run(state, args.model, requests, args.clients, args.max_tokens)
            lines.append(dict(key, kind="run", config=config, repeat=repeat, result=result, machine=machine,
                              provenance=provenance))
            with out.open("a") as f:
                f.write(json.dumps(lines[-1]) + "\n")
            print(f"{config} #{repeat}: {json.dumps(result)}", flush=True)
    print(summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
