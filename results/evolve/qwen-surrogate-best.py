# kvsieve evolved policy: program #17 (generation 2, island 0), dev score 87.1, proxy gap 0.1712
"""Evolved: add_term of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return f.surrogate + 1.0 * unit_mean(group_mean(f.attn))
