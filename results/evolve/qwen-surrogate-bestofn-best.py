# kvsieve evolved policy: program #11 (generation 1, island 0), dev score 89.3, proxy gap 0.1936
"""Evolved: add_term of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return f.surrogate + 0.1 * unit_mean(group_mean(f.attn))
