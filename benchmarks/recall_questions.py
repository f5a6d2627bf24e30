"""Compress once, ask several questions: one context's cache reused for a question about each of several keys.

Each request of kvsieve's generator's ``niah_multikey_3`` (51 lines "One of the special magic uuids for KEY is:
VALUE.") is read once; then ``--questions`` keys drawn from its lines (the request's own key among them) are asked
one after another, each answered by:

* ``full``: the full cache, reused (each question on a copy of it);
* ``pick``: the policy's compressed cache alone, reused;
* ``pick+recall``: the two tiers (``engine/tiers.py``), each question recalling into a copy of the hot tier; the
  compressed context stays as it was for the next question (checked bit for bit after the last);
* ``reread``: question-aware SnapKV at the same ratio, compressing after each question is read: a system that does
  this re-reads the context with every question, so it pays a prefill per question (computed here on a copy of the
  one read, which gives the same cache; its prefill seconds are charged per question).

Per question position: accuracy, the hot bytes, the bytes moved from the cold tier, the prefills and seconds paid.
One JSON line per (request, cell, question), appended as it lands; a killed run resumes (``--out``).

    OMP_NUM_THREADS=1 python benchmarks/recall_questions.py --samples 8 --out runs/recall-questions-qwen-4k.jsonl \\
        --recall "recall(fraction=0.025, chunk=48, pool='span')"
    python benchmarks/recall_questions.py --report runs/recall-questions-qwen-4k.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch
from recall_multikey import PICK

from kvsieve.bootstrap import bootstrap_interval
from kvsieve.engine.attach import attach
from kvsieve.engine.cache import cache_bytes, clone_cache, full_cache_bytes, sieve_layers
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

CELLS = ("full", "pick", "pick+recall", "reread")
NEEDLE = re.compile(r"One of the special magic uuids for (\S+) is: (\S+)\.")


def questions(sample, count: int) -> list[tuple[str, str, str]]:
    """``count`` (question, answer prefix, answer) about keys of the context's lines, the request's own key at a
    position drawn with the request's seed."""
    lines = NEEDLE.findall(sample.context)
    own = sample.answers[0]
    key = next(k for k, v in lines if v == own)
    rng = random.Random(sample.seed)
    others = rng.sample([(k, v) for k, v in lines if k != key], count - 1)
    others.insert(rng.randrange(count), (key, own))
    return [(sample.question.replace(key, k), sample.answer_prefix.replace(key, k), v) for k, v in others]


def done_rows(path: Path) -> dict[tuple[str, str, int], dict]:
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[(row["sample"], row["cell"], row["position"])] = row
    return rows


@torch.no_grad()
def run(args) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, dtype=args.dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    have = done_rows(out)
    recall = Recall.parse(args.recall)
    pick, snapkv = from_spec(PICK), from_spec("snapkv")
    pick.check_model(model, args.model)
    capture = Capture.of([pick, snapkv])
    spec = SampleSpec(model=args.model, tasks=["niah_multikey_3"], lengths=[args.length], samples=args.samples,
                      seed=args.seed)
    for sample in load_samples(spec, tokenizer):
        asked = questions(sample, args.questions)
        if all((sample.id, c, i) in have for c in CELLS for i in range(len(asked))):
            continue
        context_ids = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix).context_ids
        start = time.perf_counter()
        read = read_prompt(model, context_ids, capture)
        read_s = time.perf_counter() - start
        full_bytes = full_cache_bytes(read.cache)
        start = time.perf_counter()
        compressed, _ = read.pruned(pick, Budget(ratio=args.ratio))
        compress_s = time.perf_counter() - start
        start = time.perf_counter()
        tiers = read.tiered(pick, args.ratio, recall)
        tiers_s = time.perf_counter() - start
        before = [(layer.keys.clone(), layer.positions.clone()) for _, layer in sieve_layers(tiers.hot)]
        for position, (question, prefix, value) in enumerate(asked):
            prompt = build_prompt(tokenizer, sample.context, question, prefix)
            if not torch.equal(prompt.context_ids, context_ids):
                raise RuntimeError(f"{sample.id}: the context's tokens change with the question")
            for cell in CELLS:
                if (sample.id, cell, position) in have:
                    continue
                start = time.perf_counter()
                logits, moved, prefills, setup_s = None, 0, 0, 0.0
                with attach(model, capture.policy()):
                    if cell == "full":
                        cache, hot = clone_cache(read.cache), full_bytes
                    elif cell == "pick":
                        cache, hot = clone_cache(compressed), cache_bytes(compressed)
                    elif cell == "pick+recall":
                        cache, hot = tiers.question_cache(), tiers.hot_nbytes()
                    else:  # reread: context + question read, then compressed (a prefill per question)
                        qa = read.continued(prompt.question_ids)
                        cache, _ = qa.pruned(snapkv, Budget(ratio=args.ratio))
                        logits, hot, prefills, setup_s = qa.logits, cache_bytes(cache), 1, read_s
                    if logits is None:
                        logits = model(input_ids=prompt.question_ids, cache=cache, use_cache=True,
                                       logits_to_keep=1).logits[:, -1]
                    if cell == "pick+recall":
                        moved = tiers.moved_bytes
                    tokens = greedy_decode(model, tokenizer, cache, logits, sample.max_new_tokens, tuple(sample.stop))
                text = tokenizer.decode(tokens[0], skip_special_tokens=True)
                row = {"sample": sample.id, "cell": cell, "position": position, "score": score(sample.metric, text,
                                                                                            [value]),
                       "prediction": text, "answer": value, "hot_bytes": hot, "moved_bytes": moved,
                       "cold_bytes": tiers.cold_nbytes() if cell == "pick+recall" else 0, "full_bytes": full_bytes,
                       "prefills": prefills, "seconds": time.perf_counter() - start + setup_s,
                       "read_seconds": read_s, "compress_seconds": compress_s, "tiers_seconds": tiers_s,
                       "ratio": args.ratio, "recall": recall.text, "provenance": current(str(model.dtype))}
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{sample.id} q{position} {cell}: {row['score']:.0f} {row['seconds']:.1f} s {text[:50]!r}",
                      flush=True)
        after = [(layer.keys, layer.positions) for _, layer in sieve_layers(tiers.hot)]
        if not all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after)):
            raise RuntimeError(f"{sample.id}: the compressed context changed across questions")


def report(path: Path) -> None:
    rows = done_rows(path)
    samples = sorted({s for s, _, _ in rows})
    positions = sorted({p for _, _, p in rows})
    print(f"{path}: {len(samples)} contexts x {len(positions)} questions")
    for cell in CELLS:
        got = [r for (s, c, p), r in rows.items() if c == cell]
        if not got:
            continue
        lo, hi = bootstrap_interval([r["score"] for r in got])
        per_position = []
        for p in positions:
            at = [r["score"] for r in got if r["position"] == p]
            per_position.append(f"{sum(at) / len(at):.0f}" if at else "-")
        hot = sum(r["hot_bytes"] / r["full_bytes"] for r in got) / len(got)
        moved = sum(r["moved_bytes"] for r in got) / len(got)
        print(f"{cell:12s} n {len(got):3d}  {sum(r['score'] for r in got) / len(got):5.1f} [{lo:5.1f}, {hi:5.1f}]  "
              f"by position {' '.join(per_position)}  hot {100 * hot:4.1f}%  moved {moved / 2**20:.2f} MiB/q  "
              f"prefills/q {sum(r['prefills'] for r in got) / len(got):.0f}  "
              f"s/q {sum(r['seconds'] for r in got) / len(got):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument("--recall", default="recall(fraction=0.025, chunk=48, pool='span')")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/recall-questions-qwen-4k.jsonl")
    parser.add_argument("--report", metavar="JSONL", help="print the table of a run and exit")
    args = parser.parse_args()
    if args.report:
        report(Path(args.report))
    else:
        run(args)


if __name__ == "__main__":
    main()
