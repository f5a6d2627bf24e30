"""Evolved: crossover of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'floor': 30, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return 0.7 * unit_mean(0.3 * normalize(group_max(f.attn)) + 0.125 * normalize(f.surrogate)) + 0.3 * unit_mean(0.5 * unit_mean(f.surrogate))
