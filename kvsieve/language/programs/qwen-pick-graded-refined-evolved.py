# picked by the selection rule (configs/selection-graded-refined-evolved.toml): #16 of results/evolve/qwen-evolve-refined.sqlite, dev 60.7, gap 0.253, held-out 75.6
# its f.surrogate is the kvzap checkpoint results/learned/issue51/signal-fit-affine-qwen-s5000: program(path='results/evolve/picked-graded-refined-evolved/qwen2.5-coder-0.5b-instruct-picked.py', surrogate='results/learned/issue51/signal-fit-affine-qwen-s5000')
"""Evolved: wrap of a parent program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return pool(pool(f.surrogate, 5), 3)
