"""Replicas on Ray Serve: one replica against two, and two routed by document against two routed at random.

The workload: ``--documents`` RULER niah_multikey_1 documents (``--length`` tokens, the range drawn per document,
seeded), each holding four needles ("One of the special magic numbers for KEY is: N."); each document gets
``--questions`` questions, one per needle. The requests are shuffled across documents and sent by ``--clients``
streaming clients, each sending its next request when its last is answered. A reply is right when it holds its
needle's number.

Configurations (``--configs``), each a fresh ``kvsieve serve --replicas`` deployment (empty context caches) on a local
Ray instance, every replica with ``--threads`` threads (default 1) and the server flags ``--serve-flags``:

* ``one``: one replica;
* ``context``: two replicas, a document's requests routed to one (``--routing context``): each document is read once
  and its later questions hit that replica's context cache;
* ``random``: two replicas, requests routed at random (``--routing random``): a document's questions land on either,
  so it is read up to twice.

Repeat ``r`` uses documents seeded ``--seed + r`` for every configuration, run round robin (repeat 0 of each, then
repeat 1, ...) so load drifts fall on all alike. Per run: requests/s over the wall time, p50 / p95 time to first token,
right answers, context-cache hits (``usage.kv_cache.context_cache``), the requests each replica answered and how many
replicas each document reached. The summary: means with 95% t-intervals over repeats, and requests/s over ``one``'s
and over ``random``'s, paired by repeat.

Resumable: each finished run is one JSON line of ``--out``; a rerun skips those and prints the summary of all.

    python benchmarks/serve_replicas.py --repeats 3 --out results/serve/replicas.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import random
import re
import shlex
import socket
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import ray
from ray import serve
from serve_throughput import interval, percentile

from kvsieve.cli_arguments import build_parser
from kvsieve.harness.provenance import current
from kvsieve.models import load
from kvsieve.serve import replicas
from kvsieve.tasks.ruler import generate as ruler_sample

NEEDLE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")
CONFIGS = {"one": (1, "context"), "context": (2, "context"), "random": (2, "random")}


@dataclass(frozen=True)
class Request:
    document: int
    text: str
    answer: str


def workload(tokenizer, documents: int, questions: int, length: tuple[int, int], seed: int) -> list[Request]:
    """Every (document, question) request, shuffled across documents by ``seed``."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    rng = random.Random(seed)
    requests = []
    for d in range(documents):
        sample = ruler_sample("niah_multikey_1", rng.randint(*length), seed * 1000 + d, count, template_overhead=64)
        needles = NEEDLE.findall(sample.context)
        if len(needles) < questions:
            raise ValueError(f"document {d} holds {len(needles)} needles; --questions {questions} needs as many")
        asked = next(k for k, _ in needles if k in sample.question)
        for key, value in needles[:questions]:
            requests.append(Request(d, sample.context + "\n" + sample.question.replace(asked, key), value))
    rng.shuffle(requests)
    return requests


def one_run(url: str, model: str, requests: list[Request], clients: int, max_tokens: int) -> dict:
    todo: queue.Queue[Request] = queue.Queue()
    for request in requests:
        todo.put(request)

    def ask(request: Request) -> dict:
        body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": request.text}]}
        start = time.perf_counter()
        first, text, usage = None, [], None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=7200) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {reply.read()[:300]!r}")
            replica = reply.headers.get("x-kvsieve-replica")
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
        return {"document": request.document, "replica": replica, "ttft": (first or math.nan) - start,
                "latency": time.perf_counter() - start, "right": request.answer in answer,
                "hit": usage["kv_cache"].get("context_cache") == "hit"}

    def client() -> list[dict]:
        done = []
        while True:
            try:
                request = todo.get_nowait()
            except queue.Empty:
                return done
            done.append(ask(request))

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(lambda _: client(), range(clients)) for r in rs]
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    reached: dict[int, set] = {}
    for r in results:
        reached.setdefault(r["document"], set()).add(r["replica"])
    return {"wall": wall, "requests_per_s": len(results) / wall, "n": len(results),
            "right": sum(r["right"] for r in results), "hits": sum(r["hit"] for r in results),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95),
            "per_replica": sorted(Counter(r["replica"] for r in results).values(), reverse=True),
            "replicas_per_document": statistics.fmean(len(s) for s in reached.values())}


def _fmt(values: list[float], digits: int = 2) -> str:
    mean, low, high = interval(values)
    return f"{mean:.{digits}f}" if math.isnan(low) else f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def summary(lines: list[dict]) -> str:
    runs = [line for line in lines if line.get("kind") == "run"]
    if not runs:
        return "no runs yet"
    head = runs[0]
    out = [f"{head['documents']} documents x {head['questions']} questions, {head['clients']} clients, max_tokens "
           f"{head['max_tokens']}, prompts {head['prompt_tokens']} tokens, serve flags {head['serve_flags']!r}; "
           f"{head['machine']}", "",
           "| config | replicas | routing | runs | req/s | vs one, paired | vs random, paired | TTFT p50 s | "
           "TTFT p95 s | context hits | replicas a document reached | requests per replica | right |",
           "|" + "---|" * 13]

    def paired(rs: list[dict], base: str) -> str:
        by = {line["repeat"]: line["result"]["requests_per_s"] for line in runs if line["config"] == base}
        ratios = [line["result"]["requests_per_s"] / by[line["repeat"]] for line in rs if line["repeat"] in by]
        return _fmt(ratios) + "x" if ratios and rs[0]["config"] != base else "-"

    for config in dict.fromkeys(line["config"] for line in runs):
        rs = [line for line in runs if line["config"] == config]
        r = [line["result"] for line in rs]
        count, routing = CONFIGS[config]
        out.append(f"| {config} | {count} | {routing} | {len(r)} | {_fmt([x['requests_per_s'] for x in r], 3)} | "
                   f"{paired(rs, 'one')} | {paired(rs, 'random')} | {_fmt([x['ttft_p50'] for x in r], 1)} | "
                   f"{_fmt([x['ttft_p95'] for x in r], 1)} | {sum(x['hits'] for x in r)}/{sum(x['n'] for x in r)} | "
                   f"{_fmt([x['replicas_per_document'] for x in r])} | "
                   f"{' / '.join(str(x['per_replica']) for x in r)} | "
                   f"{sum(x['right'] for x in r)}/{sum(x['n'] for x in r)} |")
    return "\n".join(out)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--questions", type=int, default=4, help="questions a document (at most its 4 needles)")
    parser.add_argument("--length", default="1024-2048", help="document tokens, a range drawn per document")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (and Ray CPUs) of each replica")
    parser.add_argument("--cpus", type=int, help="CPUs of the local Ray instance (default: this machine's)")
    parser.add_argument("--serve-flags", default="--dtype float32 --kv-budget 1GiB --policy "
                        "\"kvzap(checkpoint='smollm2-135m-instruct')\" --ratio 0.875 --evict-every 0",
                        help="kvsieve serve's flags for every replica, split as a shell splits them (give them as "
                        "--serve-flags='--kv-budget 2GiB ...')")
    parser.add_argument("--configs", default="one,context,random")
    parser.add_argument("--out", default="runs/serve/replicas.jsonl", help="one JSON line per finished run")
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    if args.summary_only:
        print(summary(lines))
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}: choose from {', '.join(CONFIGS)}")
    low, high = (int(x) for x in args.length.split("-"))
    _, tokenizer = load(args.model, "float32")
    provenance = current("float32")
    machine = (f"{provenance['machine']}, {args.threads} thread(s) a replica, git {(provenance['commit'] or '?')[:7]}"
               f"{'+dirty' if provenance['dirty'] else ''}")
    key = dict(documents=args.documents, questions=args.questions, clients=args.clients, seed=args.seed,
               max_tokens=args.max_tokens, length=args.length, threads=args.threads, serve_flags=args.serve_flags)
    out.parent.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for repeat in range(args.repeats):
            requests = workload(tokenizer, args.documents, args.questions, (low, high), args.seed + repeat)
            tokens = [len(tokenizer(r.text)["input_ids"]) for r in requests]
            for config in configs:
                if any(line.get("kind") == "run" and line["config"] == config and line["repeat"] == repeat
                       and all(line.get(k) == v for k, v in key.items()) for line in lines):
                    continue
                count, routing = CONFIGS[config]
                flags = build_parser().parse_args(["--threads", str(args.threads), "serve", "--model", args.model,
                                                   "--replicas", str(count), "--routing", routing,
                                                   *shlex.split(args.serve_flags)])
                settings = replicas.check(flags)
                if replicas.APP in serve.status().applications:
                    serve.delete(replicas.APP)
                started = time.perf_counter()
                serve.run(replicas.application(settings, count, routing), name=replicas.APP, route_prefix="/")
                deployed = time.perf_counter() - started
                result = one_run(f"http://127.0.0.1:{port}", args.model, requests, args.clients, args.max_tokens)
                result["deploy_s"] = deployed
                lines.append(dict(key, kind="run", config=config, repeat=repeat, result=result, machine=machine,
                                  prompt_tokens=f"{min(tokens)}-{max(tokens)}", provenance=provenance))
                with out.open("a") as f:
                    f.write(json.dumps(lines[-1]) + "\n")
                print(f"{config} #{repeat}: {json.dumps(result)}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
