# kvsieve evolved policy: program #32 of results/evolve/smollm2-surrogate.sqlite, dev score 81.25, proxy gap 0.0133
"""Evolved: add_term of the surrogate seed."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return f.surrogate + 0.1 * unit_mean(group_mean(f.last_attn))

