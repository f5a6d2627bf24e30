"""Which of the answer's tokens each policy keeps, layer by layer, and what it then answers: one sample.

Run: python benchmarks/needle_kept.py --model qwen2.5-coder-0.5b-instruct --task niah_single_1 --length 4096 \
         --seed 0 --ratio 0.5 --policies "snapkv,snapkv(kernel_size=1),tova" --round-scores bfloat16

The sample's context is prefilled once (query-agnostic, dtype auto); each policy prunes a copy of that cache
at ``--ratio`` and reads the question on it. Printed per policy: the share of the answer span's tokens
(``Sample.spans``, e.g. the needle sentence) that each layer keeps, averaged over its KV heads, and the
greedy answer. ``--round-scores bfloat16`` scores each policy a second time from the cache's keys and
window queries rounded to bf16 (the kept entries stay in the model's dtype) and prints how much of the
kept set changes: whether a policy's choice hangs on the scoring precision or on the forward pass itself.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from kvsieve.engine import compress as compress_module
from kvsieve.engine.attach import attach
from kvsieve.engine.cache import clone_cache, sieve_layers, stack_caches
from kvsieve.engine.compress import compress_cache
from kvsieve.engine.generate import greedy_decode
from kvsieve.models import load
from kvsieve.policies import from_spec, split_specs
from kvsieve.policy import FullCache
from kvsieve.prompt import build_prompt
from kvsieve.selection import Budget
from kvsieve.tasks.load import SampleSpec, load_samples


def kept_positions(cache) -> list[list[set[int]]]:
    """Per layer, per KV head (batch row 0): the original positions it holds."""
    out = []
    for _, layer in sieve_layers(cache):
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        out.append([set(layer.positions[0, h][valid[0, h]].tolist()) for h in range(layer.positions.shape[1])])
    return out


def compressed(cache, policy, ratio: float, round_to: torch.dtype | None = None):
    out = clone_cache(cache)
    if round_to is None:
        compress_cache(out, policy, Budget(ratio=ratio))
        return out
    original = compress_module.layer_signals

    def rounded(*args, **kwargs):
        signals = original(*args, **kwargs)
        return replace(signals, keys=signals.keys.to(round_to).to(signals.keys.dtype),
                       window_queries=signals.window_queries.to(round_to).to(signals.window_queries.dtype))

    compress_module.layer_signals = rounded
    try:
        compress_cache(out, policy, Budget(ratio=ratio))
    finally:
        compress_module.layer_signals = original
    return out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--policies", default="snapkv,tova")
    parser.add_argument("--round-scores", choices=["bfloat16", "float16"], help="also score from rounded inputs")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    model, tokenizer = load(args.model, dtype=args.dtype)
    spec = SampleSpec(model=args.model, tasks=[args.task], lengths=[args.length], samples=1, seed=args.seed)
    sample = next(iter(load_samples(spec, tokenizer)))
    prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    span = set(prompt.token_positions(tokenizer, [tuple(s) for s in sample.spans]))
    policies = {text: from_spec(text) for text in split_specs(args.policies)}
    print(f"{args.model} {args.task} seed {args.seed}, {prompt.context_ids.shape[1]} context tokens, {model.dtype}; "
          f"answer {sample.answers}, answer span {len(span)} tokens; ratio {args.ratio}")

    def answer(cache) -> str:
        batch = stack_caches([cache])
        logits = model(input_ids=prompt.question_ids, cache=batch, use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens = greedy_decode(model, tokenizer, batch, logits, sample.max_new_tokens, tuple(sample.stop))
        return tokenizer.decode(tokens[0], skip_special_tokens=True)

    capture = FullCache(window=max(p.window for p in policies.values()))
    capture.needs_accumulated_attention = any(p.needs_accumulated_attention for p in policies.values())
    capture.needs_query_stats = any(p.needs_query_stats for p in policies.values())
    with attach(model, capture, ratio=0.0):
        context = model(input_ids=prompt.context_ids, use_cache=True, logits_to_keep=1).cache
        for text, policy in policies.items():
            cache = compressed(context, policy, args.ratio)
            kept = kept_positions(cache)
            shares = [sum(len(span & head) for head in layer) / (len(span) * len(layer)) for layer in kept]
            print(f"{text:28s} span kept per layer: {' '.join(f'{s:.2f}' for s in shares)}  "
                  f"(mean {sum(shares) / len(shares):.2f}); answer {answer(cache)!r}", flush=True)
            if args.round_scores:
                other = compressed(context, policy, args.ratio, getattr(torch, args.round_scores))
                again = kept_positions(other)
                same = [sum(len(a & b) for a, b in zip(la, lb)) / sum(len(a) for a in la)
                        for la, lb in zip(kept, again)]
                print(f"{'':28s} scored from {args.round_scores}-rounded keys and queries: kept set unchanged "
                      f"{min(same):.0%}-{max(same):.0%} per layer; answer {answer(other)!r}", flush=True)


if __name__ == "__main__":
    main()
