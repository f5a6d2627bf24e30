# picked by the selection rule (configs/selection-graded-refined.toml): #25 of results/evolve/qwen-rescore-refined.sqlite, dev 60.3, gap 0.124, held-out -
# its f.surrogate is the kvzap checkpoint results/learned/issue51/signal-fit-affine-qwen-s5000: program(path='results/evolve/picked-graded-refined/qwen2.5-coder-0.5b-instruct-picked.py', surrogate='results/learned/issue51/signal-fit-affine-qwen-s5000')
"""The KVzip surrogate (kvzap): predicted log KVzip scores, one budget over the whole model."""
SELECTION = {"chunk_size": 1, "sink": 0, "allocation": "global", "normalization": "none"}


def score(f):
    return f.surrogate
