"""One layer's decode attention on a ragged store against a uniform one holding as many entries (CPU, best of N).

Run: python benchmarks/ragged_attention.py   (SmolLM2's 3 KV heads of 64 and 9 query heads; float32; 1 thread)
"""

from __future__ import annotations

import time

import torch

from kvsieve.engine import attention
from kvsieve.engine.cache import SieveLayer
from kvsieve.engine.ragged import RaggedStore


def layer_for(lengths: torch.Tensor, d: int = 64) -> SieveLayer:
    b, h = lengths.shape
    width = int(lengths.max())
    keys = torch.randn(b, h, width, d)
    valid = torch.arange(width)[None, None] < lengths[..., None]
    layer = SieveLayer()
    layer.store = RaggedStore.from_dense(keys, keys.clone(), torch.arange(width).expand(b, h, width),
                                         None if bool(valid.all()) else valid)
    return layer


def best_us(fn, repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, 1 thread, float32; one layer, 3 KV heads / 9 query heads of 64, best of 200\n")
    print("| rows | mean entries per segment | uniform µs | ragged µs | ragged / uniform |\n|---|---|---|---|---|")
    for rows in (1, 8):
        for mean in (512, 2048):
            uniform = torch.full((rows, 3), mean)
            ragged = (torch.rand(rows, 3, generator=g) * 1.8 * mean + 0.1 * mean).long()
            ragged = (ragged * (mean * 3 * rows) / ragged.sum()).long().clamp(min=1)  # as many entries, spread
            query = torch.randn(rows, 9, 1, 64)
            a, b = layer_for(uniform), layer_for(ragged)
            tu = best_us(lambda a=a, q=query: attention.stored_attention(q, a, 0.125))
            tr = best_us(lambda b=b, q=query: attention.stored_attention(q, b, 0.125))
            print(f"| {rows} | {mean} | {tu:.0f} | {tr:.0f} | {tr / tu:.2f} |", flush=True)


if __name__ == "__main__":
    main()
