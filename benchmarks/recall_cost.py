"""What recall costs: per question, as a share of the context's prefill; decode speed with recall against the
compressed cache alone and the full cache; each cold format's bytes against the evicted entries' full precision.

One request of kvsieve's generator (``niah_multikey_3`` by default) is read once; then, for each sketch and cold
format, the two tiers are built and the question is read on an armed copy (recall in every layer) and, beside it, on
the compressed cache alone (no recall): the difference is recall's time. Decoding is timed on each cache for
``--decode`` tokens (greedy, EOS ignored). Timings are medians of ``--repeats``; the machine, threads and dtype are
printed with them (a loaded machine slows every figure alike; compare within one run).

    OMP_NUM_THREADS=1 python benchmarks/recall_cost.py --model qwen2.5-coder-0.5b-instruct --length 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from recall_multikey import PICK

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import cache_bytes, clone_cache, full_cache_bytes
from kvsieve.engine.reader import Capture, read_prompt
from kvsieve.harness.provenance import current
from kvsieve.models import load
from kvsieve.policies import from_spec
from kvsieve.prompt import build_prompt
from kvsieve.recall import Recall
from kvsieve.selection import Budget
from kvsieve.tasks.load import SampleSpec, load_samples


@torch.no_grad()
def _question(model, capture: Capture, cache, ids) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with attach(model, capture.policy()):
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    return time.perf_counter() - start, logits


@torch.no_grad()
def _decode(model, capture: Capture, cache, logits: torch.Tensor, tokens: int) -> float:
    """Tokens per second of ``tokens`` greedy steps on ``cache`` (EOS ignored: every run decodes as many)."""
    start = time.perf_counter()
    with attach(model, capture.policy()):
        token = logits.argmax(-1, keepdim=True)
        for _ in range(tokens):
            token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--task", default="niah_multikey_3")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--policy", default=PICK)
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument("--fraction", type=float, default=0.025)
    parser.add_argument("--chunk", type=int, default=48)
    parser.add_argument("--pool", default="span")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, dtype=args.dtype)
    policy = from_spec(args.policy)
    policy.check_model(model, args.model)
    sample = next(iter(load_samples(SampleSpec(model=args.model, tasks=[args.task], lengths=[args.length],
                                               samples=1, seed=0), tokenizer)))
    prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    capture = Capture.of([policy])
    start = time.perf_counter()
    read = read_prompt(model, prompt.context_ids, capture)
    prefill = time.perf_counter() - start
    full = full_cache_bytes(read.cache)
    print(f"{current(str(model.dtype))['machine']}; torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{model.dtype}; {args.model}, "
          f"{prompt.context_ids.shape[1]} context + {prompt.question_ids.shape[1]} question tokens; prefill "
          f"{prefill:.1f} s; point: {args.policy.rsplit('/', 1)[-1]} at ratio {args.ratio}, recall {args.fraction}")
    alone, _ = read.pruned(policy, Budget(ratio=args.ratio))
    base = [_question(model, capture, clone_cache(alone), prompt.question_ids) for _ in range(args.repeats)]
    base_s = statistics.median(t for t, _ in base)
    print(f"question on the compressed cache alone: {base_s * 1000:.0f} ms; decode "
          f"{_decode(model, capture, clone_cache(alone), base[0][1], args.decode):.2f} tok/s; hot "
          f"{100 * cache_bytes(alone) / full:.1f}% of full")
    full_q = _question(model, capture, clone_cache(read.cache), prompt.question_ids)
    print(f"full cache: question {full_q[0] * 1000:.0f} ms; decode "
          f"{_decode(model, capture, clone_cache(read.cache), full_q[1], args.decode):.2f} tok/s")
    print("| sketch | cold | split s | question + recall ms | recall ms | recall / prefill | hot % | cold MiB | "
          "cold / exact | moved KiB | decode tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    exact_cold = None
    for sketch, cold in (("exact", "exact"), ("exact", "int8"), ("exact", "int4"), ("sign", "exact"),
                         ("lowrank", "exact"), ("sign", "int4")):
        recall = Recall(args.fraction, chunk=args.chunk, pool=args.pool, sketch=sketch, cold=cold)
        start = time.perf_counter()
        tiers = read.tiered(policy, args.ratio, recall)
        split = time.perf_counter() - start
        runs = [_question(model, capture, tiers.question_cache(), prompt.question_ids) for _ in range(args.repeats)]
        q_s = statistics.median(t for t, _ in runs)
        tok_s = _decode(model, capture, _read_again(model, capture, tiers, prompt), runs[0][1], args.decode)
        exact_cold = tiers.cold_nbytes() if exact_cold is None else exact_cold
        print(f"| {sketch} | {cold} | {split:.2f} | {q_s * 1000:.0f} | {(q_s - base_s) * 1000:.0f} | "
              f"{100 * (q_s - base_s) / prefill:.2f}% | {100 * tiers.hot_nbytes() / full:.1f} | "
              f"{tiers.cold_nbytes() / 2**20:.2f} | {tiers.cold_nbytes() / exact_cold:.3f} | "
              f"{tiers.moved_bytes / 1024:.0f} | {tok_s:.2f} |")


def _read_again(model, capture: Capture, tiers, prompt):
    """A copy of the hot tier that has read the question (and recalled): the cache decoding continues on."""
    cache = tiers.question_cache()
    _question(model, capture, cache, prompt.question_ids)
    return cache


if __name__ == "__main__":
    main()
