"""SnapKV with the question in its window (issue 43, item 7): which of the needle's tokens each variant keeps, layer
by layer, and what it answers, question-aware exactly as the harness runs ``--qa-policies``.

Run: python benchmarks/snapkv_question.py --model smollm2-135m-instruct --task niah_single_1 --length 1024 \
         --seeds 0,1,2 --ratio 0.5 --policies "snapkv,snapkv(kernel_size=1),snapkv(window=16),adakv,tova"

Per sample, the context is prefilled once, the question read on a copy of that cache (its queries join the
observation window, as in ``harness/evaluate.py``), and each policy prunes a copy with the question protected.
Printed per policy: the share of the needle span's tokens (``Sample.spans``) each layer keeps, averaged over
its KV heads; the lowest share over (layer, head); and the greedy answer.
"""

from __future__ import annotations

import argparse

import torch

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import clone_cache, sieve_layers, stack_caches
from kvsieve.engine.compress import compress_cache
from kvsieve.engine.generate import greedy_decode
from kvsieve.engine.reader import Capture
from kvsieve.models import load
from kvsieve.policies import from_spec, split_specs
from kvsieve.prompt import build_prompt
from kvsieve.selection import Budget
from kvsieve.tasks.load import SampleSpec, load_samples
from kvsieve.tasks.metrics import score


def kept_positions(cache) -> list[list[set[int]]]:
    """Per layer, per KV head (batch row 0): the original positions it holds."""
    out = []
    for _, layer in sieve_layers(cache):
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        out.append([set(layer.positions[0, h][valid[0, h]].tolist()) for h in range(layer.positions.shape[1])])
    return out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--policies", default="snapkv,snapkv(kernel_size=1),snapkv(window=16),adakv,tova")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    model, tokenizer = load(args.model, dtype=args.dtype)
    policies = {text: from_spec(text) for text in split_specs(args.policies)}
    totals = dict.fromkeys(policies, 0.0)
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        spec = SampleSpec(model=args.model, tasks=[args.task], lengths=[args.length], samples=1, seed=seed)
        sample = next(iter(load_samples(spec, tokenizer)))
        prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        span = set(prompt.token_positions(tokenizer, [tuple(s) for s in sample.spans]))
        protected = prompt.question_ids.shape[1]
        print(f"{args.model} {args.task} seed {seed}: {prompt.context_ids.shape[1]} context + {protected} question "
              f"tokens, {model.dtype}; answer {sample.answers}, needle span {len(span)} tokens; ratio {args.ratio}")
        with attach(model, Capture.of(policies.values()).policy()):
            context = model(input_ids=prompt.context_ids, use_cache=True, logits_to_keep=1).cache
            full = clone_cache(context)
            first = model(input_ids=prompt.question_ids, cache=full, use_cache=True, logits_to_keep=1).logits[:, -1]
            for text, policy in policies.items():
                cache = clone_cache(full)
                compress_cache(cache, policy, Budget(ratio=args.ratio), protected)
                kept = kept_positions(cache)
                shares = [sum(len(span & head) for head in layer) / (len(span) * len(layer)) for layer in kept]
                lowest = min(len(span & head) / len(span) for layer in kept for head in layer)
                batch = stack_caches([cache])
                tokens = greedy_decode(model, tokenizer, batch, first, sample.max_new_tokens, tuple(sample.stop))
                text_out = tokenizer.decode(tokens[0], skip_special_tokens=True)
                value = score(sample.metric, text_out, sample.answers)
                totals[text] += value
                print(f"  {text:24s} needle kept per layer: {' '.join(f'{s:.2f}' for s in shares)} (lowest head "
                      f"{lowest:.2f}); answer {text_out!r} -> {value:.0f}", flush=True)
    print("mean score: " + ", ".join(f"{t} {v / len(seeds):.1f}" for t, v in totals.items()))


if __name__ == "__main__":
    main()
