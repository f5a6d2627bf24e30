# kvsieve evolved policy: program #222 (generation 27, island 0), dev score 6250.0, proxy gap 0.7048
"""Evolved: constant of a parent program."""
SELECTION = {'chunk_size': 16, 'sink': 8}

def score(f):
    return max_pool(max_pool(pool(group_mean(f.last_attn), 9), 5), 5) + 0.5 * unit_mean(1.0 / f.key_norm)
