"""Seed programs: where an evolution run starts (``--seed-programs``), in the policy language."""

from __future__ import annotations

__all__ = ["SEEDS"]

SEEDS = {
    "snapkv": '''"""SnapKV-like: window attention averaged over the query group, pooled over 5 entries."""
SELECTION = {"chunk_size": 1, "sink": 0}


def score(f):
    return pool(group_mean(f.attn), 5)
''',
    "tova": '''"""TOVA-like: attention from the last query, averaged over the query group."""
SELECTION = {"chunk_size": 1, "sink": 0}


def score(f):
    return group_mean(f.last_attn)
''',
    "frc": '''"""FRC: local attention, neighbourhood density (kernel 9) and KV-head max, chunks of 4."""
SELECTION = {"chunk_size": 4, "sink": 0}


def score(f):
    local = group_mean(f.attn)
    density = pool(local, 9)
    head_max = group_max(f.attn)
    return 0.4 * unit_mean(local) + 0.4 * unit_mean(density) + 0.2 * unit_mean(head_max)
''',
    "surrogate": '''"""The KVzip surrogate (kvzap): predicted log KVzip scores, one budget over the whole model."""
SELECTION = {"chunk_size": 1, "sink": 0, "allocation": "global", "normalization": "none"}


def score(f):
    return f.surrogate
''',
}
