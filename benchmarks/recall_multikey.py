"""Recall on the capacity cliff: one read a request, then each cell answers from its own cache (dev data).

On kvsieve's own generator's niah_multikey_3 (51 alike uuid lines, the key named only in the question), each
request is read once and answered by: the full cache; the policy alone at the point's ratio; the policy with recall
(``engine/recall.py``) at the same total hot bytes, over a grid of fractions, chunks, sketches and cold formats; and
question-aware SnapKV at the point's ratio (the shortcut recall must beat: compress after the question is read).
One JSON line per (request, cell), appended as it lands, so a killed run resumes where it stopped (``--out``).

    OMP_NUM_THREADS=1 python benchmarks/recall_multikey.py --samples 12 --out runs/recall-dev-qwen-4k.jsonl
    python benchmarks/recall_multikey.py --report runs/recall-dev-qwen-4k.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvsieve.bootstrap import bootstrap_interval
from kvsieve.engine.attach import attach
from kvsieve.engine.cache import cache_bytes, full_cache_bytes
from kvsieve.engine.generate import greedy_decode
from kvsieve.engine.reader import Capture, read_prompt
from kvsieve.harness.provenance import current
from kvsieve.models import load
from kvsieve.policies import from_spec
from kvsieve.prompt import build_prompt
from kvsieve.recall import Recall
from kvsieve.selection import Budget
from kvsieve.tasks.load import SampleSpec, load_samples
from kvsieve.tasks.metrics import score

PICK = "program:qwen-pick-floor-high"
# name -> (policy spec, recall or None, question-aware)
CELLS = {
    "full": ("full", None, False),
    "pick": (PICK, None, False),
    "pick+r2.5-c16": (PICK, Recall(0.025, chunk=16), False),
    "pick+r2.5-c32": (PICK, Recall(0.025, chunk=32), False),
    "pick+r2.5-s32": (PICK, Recall(0.025, chunk=32, pool="span"), False),
    "pick+r2.5-s48": (PICK, Recall(0.025, chunk=48, pool="span"), False),
    "pick+r2.5-s48-shared": (PICK, Recall(0.025, chunk=48, pool="span", heads="shared"), False),
    "pick+r5-c16": (PICK, Recall(0.05, chunk=16), False),
    "pick+r2.5-s48-sign": (PICK, Recall(0.025, chunk=48, pool="span", sketch="sign"), False),
    "pick+r2.5-s48-lowrank": (PICK, Recall(0.025, chunk=48, pool="span", sketch="lowrank"), False),
    "pick+r2.5-s48-int8": (PICK, Recall(0.025, chunk=48, pool="span", cold="int8"), False),
    "pick+r2.5-s48-int4": (PICK, Recall(0.025, chunk=48, pool="span", cold="int4"), False),
    "snapkv+qa": ("snapkv", None, True),
}


def done_rows(path: Path) -> dict[tuple[str, str], dict]:
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[(row["sample"], row["cell"])] = row
    return rows


@torch.no_grad()
def answer(model, tokenizer, sample, cache, logits, question_ids, capture: Capture, max_new: int) -> tuple[str, float]:
    start = time.perf_counter()
    with attach(model, capture.policy()):
        if logits is None:
            logits = model(input_ids=question_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens = greedy_decode(model, tokenizer, cache, logits, max_new, tuple(sample.stop))[0]
    return tokenizer.decode(tokens, skip_special_tokens=True), time.perf_counter() - start


def run(args) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, dtype=args.dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    have = done_rows(out)
    cells = {name: CELLS[name] for name in args.cells.split(",")} if args.cells else CELLS
    policies = {spec: from_spec(spec) for spec, _, _ in cells.values()}
    for policy in policies.values():
        policy.check_model(model, args.model)
    spec = SampleSpec(model=args.model, tasks=[args.task], lengths=[args.length], samples=args.samples, seed=args.seed)
    for sample in load_samples(spec, tokenizer):
        todo = [name for name in cells if (sample.id, name) not in have]
        if not todo:
            continue
        prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        capture = Capture.of(policies.values())
        start = time.perf_counter()
        read = read_prompt(model, prompt.context_ids, capture)
        read_s = time.perf_counter() - start
        full_bytes = full_cache_bytes(read.cache)
        for name in todo:
            text_spec, recall, aware = cells[name]
            policy = policies[text_spec]
            start = time.perf_counter()
            hot = cold = moved = 0
            if recall is not None:
                tiers = read.tiered(policy, args.ratio, recall)
                cache, logits = tiers.question_cache(), None
                hot, cold = tiers.hot_nbytes(), tiers.cold_nbytes()
            elif aware:
                qa = read.continued(prompt.question_ids)
                cache, _ = qa.pruned(policy, Budget(ratio=args.ratio))
                logits, hot = qa.logits, cache_bytes(cache)
            else:
                cache, _ = read.pruned(policy, Budget(ratio=args.ratio) if policy.evicts else None)
                logits, hot = None, cache_bytes(cache)
            split_s = time.perf_counter() - start
            text, answer_s = answer(model, tokenizer, sample, cache, logits, prompt.question_ids, capture,
                                    sample.max_new_tokens)
            if recall is not None:
                moved = tiers.moved_bytes
            row = {"sample": sample.id, "cell": name, "score": score(sample.metric, text, sample.answers),
                   "prediction": text, "answers": list(sample.answers), "hot_bytes": hot, "cold_bytes": cold,
                   "moved_bytes": moved, "full_bytes": full_bytes, "read_seconds": read_s, "split_seconds": split_s,
                   "answer_seconds": answer_s, "context_tokens": prompt.context_ids.shape[1], "ratio": args.ratio,
                   "provenance": current(str(model.dtype))}
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{sample.id} {name}: {row['score']:.0f} hot {hot / full_bytes:.3f} of full, "
                  f"{split_s + answer_s:.1f} s  {text[:60]!r}", flush=True)


def report(path: Path) -> None:
    rows = done_rows(path)
    samples = sorted({s for s, _ in rows})
    full = {s: rows[(s, "full")]["score"] for s in samples if (s, "full") in rows}
    print(f"{path}: {len(samples)} requests")
    for cell in CELLS:
        got = [rows[(s, cell)] for s in samples if (s, cell) in rows]
        if not got:
            continue
        scores = [r["score"] for r in got]
        lo, hi = bootstrap_interval(scores)
        hot = sum(r["hot_bytes"] / r["full_bytes"] for r in got) / len(got)
        right_of_full = [rows[(s, cell)]["score"] for s in full if full[s] > 0 and (s, cell) in rows]
        print(f"{cell:24s} n {len(got):3d}  score {sum(scores) / len(scores):5.1f} [{lo:5.1f}, {hi:5.1f}]  "
              f"on full's right {sum(right_of_full) / max(len(right_of_full), 1):5.1f} (n {len(right_of_full)})  "
              f"hot {100 * hot:4.1f}%  answer {sum(r['answer_seconds'] for r in got) / len(got):.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--task", default="niah_multikey_3")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument("--cells", default="", help="comma-separated cell names (default: all)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/recall-dev-qwen-4k.jsonl")
    parser.add_argument("--report", metavar="JSONL", help="print the table of a run and exit")
    args = parser.parse_args()
    if args.report:
        report(Path(args.report))
    else:
        run(args)


if __name__ == "__main__":
    main()
