# picked by the selection rule (configs/selection-floor-high-qwen-4k.toml): #3 of results/evolve/floor-qwen-4k/floor-high.sqlite, dev 61.3, gap 0.054, held-out -
"""Evolved: wrap of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'floor': 40, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return pool(0.3 * normalize(group_max(f.attn)) + 0.125 * normalize(f.surrogate), 3)
