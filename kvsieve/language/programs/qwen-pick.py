# picked by the selection rule (configs/selection.toml): #325 of results/evolve/qwen-v2.sqlite, dev 93.8, gap 0.160, held-out 63.8
"""Evolved: swap of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return f.surrogate + 0.5 * unit_mean(pool(group_mean(f.attn), 1)) + 0.25 * unit_mean(group_mean(f.last_attn)) + 0.1 * rank(normalize(group_max(f.last_attn)))
