"""What ragged storage costs beyond the entries it holds: segments share a capacity within their bucket (at most
BUCKETS per layer), so a bucket is as long as its longest segment. Per policy and ratio, on a bundled model and
one RULER sample: entries held, entries allocated right after the prune, and what one padded tensor per layer
(every segment as long as the layer's longest) would take instead.

Run: python benchmarks/ragged_padding.py [--model smollm2-135m-instruct] [--length 2048] [--ratios 0.5,0.875]
"""

from __future__ import annotations

import argparse

import torch

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.models import load
from kvsieve.policies import parse
from kvsieve.prompt import build_prompt
from kvsieve.tasks import generate as make_sample

POLICIES = ["snapkv(allocation='global', normalization='zscore')", "kvzap(checkpoint='{model}', allocation='global')",
            "adakv"]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--ratios", default="0.5,0.875")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load(args.model, dtype=args.dtype)
    sample = make_sample("niah_single_1", length=args.length, seed=0,
                         count_tokens=lambda text: len(tokenizer(text)["input_ids"]))
    prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    print("| policy | ratio | entries held | allocated / held | one padded tensor per layer / held |\n"
          "|---|---|---|---|---|")
    for text in POLICIES:
        text = text.format(model=args.model)
        policy = parse(text).build()
        for ratio in (float(x) for x in args.ratios.split(",")):
            with kvsieve.attach(model, policy, ratio=ratio):
                cache = model(input_ids=prompt.context_ids, use_cache=True, logits_to_keep=1).cache
            held = allocated = padded = 0
            for _, layer in sieve_layers(cache):
                lengths = layer.store.lengths if layer.store is not None else torch.tensor(layer.head_lengths)
                held += int(lengths.sum())
                allocated += layer.allocated_bytes() // layer.entry_bytes()
                padded += int(lengths.max()) * lengths.numel()
            print(f"| {text} | {ratio} | {held} | {allocated / held:.2f} | {padded / held:.2f} |", flush=True)


if __name__ == "__main__":
    main()
