# ablation: results/evolve/smollm2-surrogate-best.py without its f.surrogate term
"""The best surrogate-evolved program with f.surrogate removed."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return 0.1 * unit_mean(group_mean(f.last_attn))

