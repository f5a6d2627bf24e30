"""Evolved: swap of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return f.surrogate + 0.5 * unit_mean(pool(group_mean(f.attn), 1)) + 0.25 * unit_mean(group_mean(f.last_attn)) + 0.1 * unit_mean(rank(group_max(f.last_attn)))
