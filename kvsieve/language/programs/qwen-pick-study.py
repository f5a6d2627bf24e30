# picked by the selection rule (configs/selection-study-qwen-2k.toml): #32 of results/evolve/compare-qwen-2k/evolve_random-s4.sqlite, dev 62.2, gap 0.127, held-out -
"""Evolved: swap of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return 0.3 * normalize(group_max(f.attn)) + 0.125 * normalize(f.surrogate)
