"""Evolved: add_term of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return f.surrogate + 1.0 * unit_mean(f.value_norm) + 0.1 * unit_mean(group_max(f.attn))
