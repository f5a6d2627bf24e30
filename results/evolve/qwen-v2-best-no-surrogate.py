# ablation: results/evolve/qwen-v2-best.py (#72) without its f.surrogate term
"""The Qwen v2 evolution's dev best with f.surrogate removed: window attention alone, one global budget."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return 0.3125 * unit_mean(group_mean(f.attn))
