# picked by the selection rule (configs/selection-graded.toml): #22 of results/evolve/qwen-rescore.sqlite, dev 59.9, gap 0.124, held-out -
"""Evolved: crossover of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return 0.7 * unit_mean(f.surrogate + 0.5 * unit_mean(pool(group_mean(f.attn), 1)) + 0.25 * unit_mean(group_mean(f.last_attn)) + 0.1 * unit_mean(normalize(group_max(f.last_attn))) + 0.2 * unit_mean(1.0 / f.key_norm)) + 0.3 * unit_mean(f.surrogate + 0.5 * unit_mean(pool(group_mean(f.attn), 1)) + 0.25 * unit_mean(group_mean(f.attn)) + 0.1 * unit_mean(rank(group_mean(f.attn))))
