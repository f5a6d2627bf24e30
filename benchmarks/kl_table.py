"""The learned policy's own objective on held-out samples: mean KL to the full cache, per policy and ratio.

Run: python benchmarks/kl_table.py --model smollm2-135m-instruct --length 2048 --samples 3 \
         --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1 \
         --policies "h2o,snapkv,tova,streaming_llm,knorm,frc,learned(checkpoint='smollm2-135m-instruct')" \
         --ratios 0.5,0.75

Each sample (evaluation seeds from --seed, disjoint from training's 5000+) is an episode as
``kvsieve train`` builds it: the chat-templated context, then the question and the first reference
answer read with teacher forcing. Per policy and ratio the context is prefilled and compressed under
``kvsieve.attach`` (prefill mode), the continuation is read on the pruned cache, and the KL
divergence KL(full || compressed) of the next-token distributions is averaged over the continuation's
positions (the reward REINFORCE maximises is minus this number; the teacher keeps its top 256 tokens
and one bin for the rest, as in training). Printed: the mean over samples, per ratio, with a 95% bootstrap
interval over samples, and each policy's paired difference from the first one given (a negative
difference: lower KL than the first), with its paired bootstrap interval.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import kvsieve
from kvsieve.bootstrap import bootstrap_interval
from kvsieve.learn.reward import kl_per_position
from kvsieve.learn.rollout import continuation_logits, teacher_for
from kvsieve.learn.train_config import episodes_from_samples
from kvsieve.models import load
from kvsieve.policies import from_spec, split_specs
from kvsieve.tasks.load import SampleSpec, load_samples


@torch.no_grad()
def compressed_logits(model, episode, policy, ratio: float) -> torch.Tensor:
    with kvsieve.attach(model, policy, ratio=ratio):
        cache = model(input_ids=episode.context, use_cache=True, logits_to_keep=1).cache
    return continuation_logits(model, cache, episode, policy.window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1")
    parser.add_argument("--samples", type=int, default=3, help="per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="h2o,snapkv,tova,streaming_llm,knorm,frc")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, every core; "
                        "1 beside another job on a 2-core machine)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    model, tokenizer = load(args.model, dtype=args.dtype)
    spec = SampleSpec(model=args.model, tasks=args.tasks.split(","), lengths=[args.length], samples=args.samples,
                      seed=args.seed)
    episodes = episodes_from_samples(list(load_samples(spec, tokenizer)), tokenizer)
    specs, ratios = split_specs(args.policies), [float(r) for r in args.ratios.split(",")]
    kl: dict[tuple[str, float], list[float]] = defaultdict(list)
    for i, episode in enumerate(episodes):
        teacher = teacher_for(model, episode, "prefill", 1, 1, 256)
        for spec in specs:
            for ratio in ratios:
                logits = compressed_logits(model, episode, from_spec(spec), ratio)
                kl[(spec, ratio)].append(float(kl_per_position(teacher, logits).mean()))
        print(f"sample {i + 1}/{len(episodes)} done", flush=True)
    print(f"\n{args.model}, {args.length} tokens, {len(episodes)} held-out samples (seeds from {args.seed}); "
          "mean KL(full || compressed) per continuation token, lower is better\n")
    print("| policy | " + " | ".join(str(r) for r in ratios) + " |")
    print("|---|" + "---:|" * len(ratios))

    def cell(values: list[float]) -> str:
        low, high = bootstrap_interval(values)
        return f"{sum(values) / len(values):.3f} [{low:.3f}, {high:.3f}]"

    for spec in sorted(specs, key=lambda s: sum(sum(kl[(s, r)]) for r in ratios)):
        print(f"| {spec} | " + " | ".join(cell(kl[(spec, r)]) for r in ratios) + " |")
    first = specs[0]
    for spec in specs[1:]:  # paired over the same samples
        diffs = [cell([a - b for a, b in zip(kl[(spec, r)], kl[(first, r)])]) for r in ratios]
        print(f"| {spec} - {first} | " + " | ".join(diffs) + " |")


if __name__ == "__main__":
    main()
