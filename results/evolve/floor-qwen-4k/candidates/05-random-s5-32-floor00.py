"""Random program."""
SELECTION = {'chunk_size': 1, 'sink': 0, 'floor': 0, 'allocation': 'global', 'normalization': 'none'}

def score(f):
    return 1.0 * normalize(f.surrogate)
