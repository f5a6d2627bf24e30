# kvsieve evolved policy: program #1 (generation 0, island 0), dev score 0.0, proxy gap 2.5897
"""SnapKV-like: window attention averaged over the query group, pooled over 5 entries."""
SELECTION = {"chunk_size": 1, "sink": 0}


def score(f):
    return pool(group_mean(f.attn), 5)
