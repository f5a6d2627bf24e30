# kvsieve evolved policy: program #72 (generation 8, island 1), dev score 91.2, proxy gap 0.1807
"""Evolved: constant of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return f.surrogate + 0.3125 * unit_mean(group_mean(f.attn))
