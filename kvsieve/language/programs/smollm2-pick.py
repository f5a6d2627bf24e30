# picked by the selection rule (configs/selection.toml): #32 of results/evolve/smollm2-surrogate.sqlite, dev 81.2, gap 0.013, held-out -
"""Evolved: add_term of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return f.surrogate + 0.1 * unit_mean(group_mean(f.last_attn))
