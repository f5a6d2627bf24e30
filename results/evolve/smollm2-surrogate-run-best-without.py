# kvsieve evolved policy: program #9 of results/evolve/smollm2-surrogate.sqlite (the run's best without f.surrogate), dev score 81.25, proxy gap 0.0803
"""Evolved: add_term of a parent program."""
SELECTION = {'chunk_size': 16, 'sink': 8}

def score(f):
    return max_pool(max_pool(pool(group_mean(f.last_attn), 9), 5), 5) + 0.5 * unit_mean(1.0 / f.key_norm) + 1.0 * unit_mean(f.value_norm)

