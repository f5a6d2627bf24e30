# picked by the selection rule (configs/selection-floor-qwen-4k.toml): #8 of results/evolve/floor-qwen-4k/floor.sqlite, dev 60.9, gap 0.055, held-out -
"""Evolved: wrap of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'floor': 30, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return pool(0.3 * normalize(group_max(f.attn)) + 0.125 * normalize(f.surrogate), 3)
