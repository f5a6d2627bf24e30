"""Evolved: swap of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'floor': 50, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return 0.3 * normalize(group_max(f.attn)) + 0.125 * normalize(f.surrogate)
