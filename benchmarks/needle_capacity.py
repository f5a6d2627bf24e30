"""How many of a needle task's key-value pairs a query-agnostic cache can hold at all: one row per task and ratio.

Run: python benchmarks/needle_capacity.py --model qwen2.5-coder-0.5b-instruct --length 4096 --samples 4 \
         --tasks niah_single_1,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery

A policy that does not see the question must keep every pair the question might ask about. Per task (first
RULER layout, `tasks/ruler.py`; averaged over the samples): the context's tokens, the needle sentences in it
(`One of the special magic ... for KEY is: VALUE.`, the asked ones and the distractors), the tokens of their
keys and values, and at each ratio the entries one KV head keeps (the budget, spread evenly) divided by those
tokens (``share at R``): above 1 every pair can fit; below 1 at most that share of them can, whatever the
policy ranks first.
An estimate, not a bound on a model's score: a kept entry's key and value also carry what its layer mixed in
from earlier positions, and global allocation gives some heads more than the even share.
"""

from __future__ import annotations

import argparse
import re

from kvsieve.bundled import BUNDLED
from kvsieve.models import load
from kvsieve.tasks.load import SampleSpec, load_samples

NEEDLE = re.compile(r"One of the special magic \w+ for ([\w-]+) is: ([\w-]+)\.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", choices=sorted(BUNDLED))
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default="niah_single_1,niah_multikey_1,niah_multikey_2,niah_multikey_3,"
                        "niah_multivalue,niah_multiquery")
    parser.add_argument("--ratios", default="0.5,0.75,0.875")
    args = parser.parse_args()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if not t.startswith("niah_")]
    if bad:
        parser.error(f"--tasks: {', '.join(bad)} are not needle tasks (niah_*) of the first layout")
    ratios = [float(r) for r in args.ratios.split(",")]
    _, tokenizer = load(args.model)  # the one loader (converts the bundled weights on a fresh machine)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    spec = SampleSpec(model=args.model, tasks=tasks, lengths=[args.length], samples=args.samples, seed=args.seed)
    rows: dict[str, list[tuple[int, int, int]]] = {t: [] for t in tasks}
    for sample in load_samples(spec, tokenizer):
        pairs = NEEDLE.findall(sample.context)
        rows[sample.task].append((count(sample.context), len(pairs),
                                  sum(count(" " + key) + count(" " + value) for key, value in pairs)))
    print(f"{args.model}, {args.length} tokens, {args.samples} samples a task from seed {args.seed}")
    header = "| task | context tokens | needles | key+value tokens | " + " | ".join(
        f"share at {r}" for r in ratios) + " |"
    print(header)
    print("|---" * (4 + len(ratios)) + "|")
    for task, found in rows.items():
        context, needles, kv = (sum(x[i] for x in found) / len(found) for i in range(3))
        shares = [(1 - r) * context / kv for r in ratios]
        print(f"| {task} | {context:.0f} | {needles:.0f} | {kv:.0f} | " + " | ".join(f"{s:.2f}" for s in shares) + " |")


if __name__ == "__main__":
    main()
