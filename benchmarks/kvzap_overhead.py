"""What the KVzip surrogate (kvzap) costs next to a plain prefill.

Run: python benchmarks/kvzap_overhead.py --model smollm2-135m --length 2048 --repeats 5 --threads 1
The context is generated prose cut to --length tokens inside the chat template (as benchmarks/kvzip_cost.py).
Per round, interleaved after one warm-up round: the plain prefill (nothing compressed), the surrogate's scoring
of every layer of the captured cache (pre-RoPE inversion + network, both variants), and the prefill under
kvsieve.attach with kvzap at --ratio (prefill + scoring + global selection + gather). Medians of wall and of
process CPU time (less hit by other jobs on a shared machine), each as a % of the same round's plain prefill.
--policy SPEC times another policy's whole compression the same way (e.g. an evolved program reading the surrogate:
--policy program:results/evolve/qwen-surrogate-bestofn-best.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from kvzip_cost import context_text  # benchmarks/, run as a script

import kvsieve
from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.compress import layer_signals
from kvsieve.models import load
from kvsieve.policies import FullCache, from_spec
from kvsieve.policies.kvzap import KVzap
from kvsieve.prompt import build_prompt


def percent(times: list[float], base: list[float]) -> str:
    shares = [100 * t / b for t, b in zip(times, base)]
    return f"{statistics.median(times) * 1000:.1f} ms = {statistics.median(shares):.2f}% of the plain prefill"


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--checkpoint", default=None, help="kvzap checkpoint (default: the shipped one of --model)")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--policy", default=None, help="time this policy spec's compression instead of the shipped "
                        "kvzap's (the scoring rows stay kvzap's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (several threads on a loaded machine "
                        "make every small op wait for a descheduled thread)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load(args.model)
    ids = build_prompt(tokenizer, context_text(tokenizer, args.length), "What is the special number?").context_ids
    policies = {v: KVzap(checkpoint=args.checkpoint or args.model, variant=v) for v in ("mlp", "linear")}
    shipped = KVzap(checkpoint=args.checkpoint or args.model)  # the checkpoint's default variant
    timed = from_spec(args.policy) if args.policy else shipped
    timed.check_model(model, args.model)  # binds the shipped surrogate of a program reading f.surrogate
    timed_name = args.policy or f"kvzap {shipped.variant} (the default)"
    print(f"# {args.model} ({model.dtype}), {ids.shape[1]} prompt tokens, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.1f}")
    with kvsieve.attach(model, FullCache(window=1), ratio=0.0):
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).cache
    layers = sieve_layers(cache)

    def scoring(policy):
        for idx, layer in layers:
            policy.score(layer_signals(layer, idx, len(cache.layers), 0, 1))

    def attached():
        with kvsieve.attach(model, timed, ratio=args.ratio) as session:
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return session.report

    def plain():
        with kvsieve.attach(model, FullCache(window=1), ratio=0.0):
            model(input_ids=ids, use_cache=True, logits_to_keep=1)

    runs = {"plain prefill (kvsieve.attach, full cache)": plain,
            "kvzap scoring, every layer (mlp)": lambda: scoring(policies["mlp"]),
            "kvzap scoring, every layer (linear)": lambda: scoring(policies["linear"]),
            f"prefill + {timed_name} @ {args.ratio}": attached}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    engine = []
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            out = run()
            if round_:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                if out is not None:
                    engine.append(out.seconds)
    base_wall, base_cpu = wall[next(iter(runs))], cpu[next(iter(runs))]
    for name in runs:
        print(f"{name}: wall {percent(wall[name], base_wall)}; CPU {percent(cpu[name], base_cpu)}")
    print(f"compression inside the engine ({timed_name}: scoring + selection + gather): "
          f"{percent(engine, base_wall)} (wall)")
    for variant, policy in policies.items():
        print(f"{variant}: {policy.net.num_parameters(variant)} parameters over {policy.net.config.num_layers} layers")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
