# kvsieve evolved policy: program #41 (generation 5, island 1), dev score 31.2, proxy gap 1.1051
"""Evolved: swap of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0}

def score(f):
    return pool(group_mean(f.last_attn), 5)
