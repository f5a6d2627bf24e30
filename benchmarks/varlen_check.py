"""On a GPU: ragged attention through ``varlen_attn`` equals the padded sdpa path (bf16 rounding), and its time.

Run: python benchmarks/varlen_check.py   (needs CUDA; benchmarks/device_check.sh runs it)
"""

from __future__ import annotations

import time
from functools import partial

import torch

from kvsieve.engine import attention
from kvsieve.engine.cache import SieveLayer
from kvsieve.engine.ragged import RaggedStore


def ragged_layer(rows: int, heads: int, mean: int, d: int, device, dtype) -> SieveLayer:
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = (torch.rand(rows, heads, generator=g) * 1.5 * mean + 0.25 * mean).long()
    width = int(lengths.max())
    keys = torch.randn(rows, heads, width, d, generator=g).to(device, dtype)
    valid = (torch.arange(width)[None, None, :] < lengths[..., None]).to(device)
    positions = torch.arange(width).expand(rows, heads, width).to(device)
    layer = SieveLayer()
    layer.store = RaggedStore.from_dense(keys, keys.flip(-1).contiguous(), positions, valid, spare=64)
    return layer


def padded_attention(query: torch.Tensor, layer: SieveLayer) -> torch.Tensor:
    """``stored_attention`` with the varlen path switched off."""
    saved, attention._VARLEN = attention._VARLEN, None
    try:
        return attention.stored_attention(query, layer, 128 ** -0.5)
    finally:
        attention._VARLEN = saved


def timed(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, varlen: {attention._VARLEN is not None}, "
          f"seqused_k: {bool(attention._VARLEN and attention._VARLEN[1])}")
    print("| mean entries per head | rows | q | max abs diff varlen vs padded | varlen µs | padded µs |")
    print("|---|---|---|---|---|---|")
    for mean in (4096, 16384):
        for rows, q in ((1, 1), (8, 1), (1, 16)):
            layer = ragged_layer(rows, 8, mean, 128, device, dtype)
            query = torch.randn(rows, 32, q, 128, device=device, dtype=dtype)
            varlen = partial(attention.stored_attention, query, layer, 128 ** -0.5)
            padded = partial(padded_attention, query, layer)
            diff = (varlen().float() - padded().float()).abs().max().item()
            print(f"| {mean} | {rows} | {q} | {diff:.4f} | {timed(varlen):.0f} | {timed(padded):.0f} |", flush=True)
    if attention._varlen_failed:
        print("varlen failed:", attention._varlen_failed[0])


if __name__ == "__main__":
    main()
