"""Engine speed and memory: prefill speed per dtype, prefill overhead of each policy, cache bytes kept, decode tokens/s.

Run: python benchmarks/engine_speed.py --model qwen2.5-0.5b --length 4096
     python benchmarks/engine_speed.py --model qwen2.5-0.5b --prefill-only     # the prefill table alone
Prints Markdown tables (used in the README). Timings are medians over --repeats runs after one
warm-up.

Prefill table: the prompt's forward under ``kvsieve.attach(model, full, ratio=0.0)`` at each of
--prefill-lengths, for each of --dtypes, once with the attention kvsieve takes (blocked matrix
products for bf16 on the CPU where torch's threads do not spin-wait, torch's sdpa kernel otherwise;
see kvsieve.engine.attention.use_blocked_prefill) and once with the other one, with the achieved
rate against the machine's matmul rate (a 4096 x 4096 square matmul in that dtype, same threads).
On a shared machine run it as ``OMP_WAIT_POLICY=PASSIVE python benchmarks/engine_speed.py ...``
(see kvsieve.engine.attention). FLOPs of a prefill of n tokens:

    2 * P * n  +  L * 4 * (n^2 / 2) * H * d

P: weights of the decoder's linear layers (the embedding lookup is no product, and the LM head runs
on the last token only), L layers, H query heads of dimension d; the attention term counts QK^T and
PV over the causal half. Norms, rotary embedding, activations and the softmax are not counted.

Policy table: "compress ms" is the time spent scoring, selecting and gathering (measured inside the
engine), "overhead" compares the whole prefill under the policy with the plain model's prefill.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import kvsieve
import kvsieve.engine.attention
import kvsieve.engine.cache
from kvsieve.models import auto_dtype, cpu_flags, load, resolve_dtype
from kvsieve.tasks.haystack import prose


def context_ids(tokenizer, length: int, seed: int = 0) -> torch.Tensor:
    sentences = 64
    while True:
        ids = tokenizer(prose(sentences, seed=seed), add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return torch.tensor([ids[:length]])
        sentences *= 2


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_rate(dtype: torch.dtype, size: int = 4096, repeats: int = 3) -> float:
    """GFLOP/s of a (size x size) @ (size x size) product in ``dtype``, best of ``repeats``."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.matmul(a, b)
    best = min(_seconds(lambda: torch.matmul(a, b)) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prefill_flops(model, tokens: int) -> float:
    """2 * P * n + L * 4 * (n^2 / 2) * H * d (see the module docstring)."""
    head = model.get_output_embeddings()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * linear * tokens + config.num_hidden_layers * 4 * (tokens**2 / 2) * heads * head_dim


@torch.no_grad()
def prefill_table(model_name: str, dtypes: list[str], lengths: list[int], repeats: int) -> None:
    attention = kvsieve.engine.attention
    switch, dtypes_default = attention.BLOCKED_PREFILL, set(attention.BLOCKED_PREFILL_DTYPES)
    flags = cpu_flags()
    chosen, reason = auto_dtype()
    print(f"# CPU flags: avx512_bf16 {'yes' if 'avx512_bf16' in flags else 'no'}, "
          f"amx_bf16 {'yes' if 'amx_bf16' in flags else 'no'}; dtype auto picks {str(chosen)[6:]} ({reason})")
    wait = os.environ.get("OMP_WAIT_POLICY", "unset (libgomp spins)")
    print(f"# OMP_WAIT_POLICY {wait}, GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', 'unset')}; "
          f"KVSIEVE_BLOCKED_PREFILL {switch}")
    print("\n| dtype | tokens | path kvsieve takes | prefill s | GFLOP | GFLOP/s | of matmul rate | other path |"
          " other path s | other GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in dtypes:
        dtype = resolve_dtype(name)
        rate = matmul_rate(dtype)
        model, tokenizer = load(model_name, dtype=dtype)
        taken = "blocked" if attention.use_blocked_prefill(dtype) else "sdpa kernel"
        for length in lengths:
            ids = context_ids(tokenizer, length)
            flops = prefill_flops(model, length)

            def run(model=model, ids=ids):
                with kvsieve.attach(model, kvsieve.policies.get("full"), ratio=0.0):
                    model(input_ids=ids, use_cache=True, logits_to_keep=1)

            seconds = {}
            for path in (taken, "sdpa kernel" if taken == "blocked" else "blocked"):
                attention.BLOCKED_PREFILL = "1" if path == "blocked" else "0"
                attention.BLOCKED_PREFILL_DTYPES = dtypes_default | {dtype}  # float32 too, to compare
                seconds[path] = timed(run, repeats)[0]
            attention.BLOCKED_PREFILL, attention.BLOCKED_PREFILL_DTYPES = switch, dtypes_default
            (path, mine), (other, theirs) = seconds.items()
            print(f"| {str(dtype)[6:]} | {length} | {path} | {mine:.3f} | {flops / 1e9:.0f} | "
                  f"{flops / mine / 1e9:.0f} | {100 * flops / mine / 1e9 / rate:.0f}% of {rate:.0f} | {other} | "
                  f"{theirs:.3f} | {flops / theirs / 1e9:.0f} |", flush=True)
        del model


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio for the prefill rows")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--policies", default=",".join(kvsieve.policies.names(kinds=("policy",))))
    parser.add_argument("--dtype", default="auto", help="dtype of the policy and decode tables")
    parser.add_argument("--prefill-lengths", default="1024,2048,4096", help="prefill table lengths ('' skips it)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="prefill table dtypes")
    parser.add_argument("--prefill-only", action="store_true", help="only the prefill table")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, the machine's cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"# {args.model}, {torch.get_num_threads()} threads, {cpu_name()}")
    lengths = [int(x) for x in args.prefill_lengths.split(",") if x.strip()]
    if lengths:
        prefill_table(args.model, args.dtypes.split(","), lengths, args.repeats)
    if args.prefill_only:
        return
    model, tokenizer = load(args.model, dtype=args.dtype)
    ids = context_ids(tokenizer, args.length)
    print(f"\n# {args.model}, {args.length} tokens, {model.dtype}")
    plain, _ = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), args.repeats)
    print(f"plain prefill: {plain:.3f} s\n")
    print("| policy | prefill s | overhead | compress ms | compress / prefill | cache MiB kept (of full) |")
    print("|---|---|---|---|---|---|")
    for name in args.policies.split(","):
        policy = kvsieve.policies.get(name)

        def run(policy=policy):
            with kvsieve.attach(model, policy, ratio=args.ratio) as session:
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            return session.report, kvsieve.engine.cache.cache_bytes(out.cache)

        seconds, (report, kept) = timed(run, args.repeats)
        full = report.bytes_before if report.layers else kept
        print(f"| {name} | {seconds:.3f} | {100 * (seconds / plain - 1):+.1f}% | {1000 * report.seconds:.1f} | "
              f"{100 * report.seconds / plain:.2f}% | {kept / 2**20:.1f} ({full / 2**20:.1f}) |", flush=True)

    print("\n| ratio | kept tokens/layer | cache MiB | decode tokens/s |")
    print("|---|---|---|---|")
    for ratio in (0.0, 0.5, 0.875):
        with kvsieve.attach(model, kvsieve.policies.get("snapkv"), ratio=ratio) as session:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = out.cache
            start = time.perf_counter()
            # no EOS stop: force exactly --decode-tokens steps by decoding with an empty EOS set
            tokens = _decode_fixed(model, cache, out.logits[:, -1], args.decode_tokens)
            rate = tokens / (time.perf_counter() - start)
        mib = kvsieve.engine.cache.cache_bytes(cache) / 2**20
        print(f"| {ratio} | {max(session.kept_tokens)} | {mib:.1f} | {rate:.1f} |", flush=True)


def _decode_fixed(model, cache, logits, steps: int) -> int:
    for _ in range(steps):
        token = logits.argmax(dim=-1, keepdim=True)
        logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    return steps


if __name__ == "__main__":
    main()
