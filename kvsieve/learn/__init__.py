"""Learned eviction (DistillCache): a small policy network over per-entry signals, trained with REINFORCE.

DistillCache (the paper's abstract) casts KV-cache eviction as a sequential
decision problem: a lightweight network reads internal model signals (attention statistics, value
norms, entropy, position) and decides what to evict; REINFORCE trains it on a per-step reward, minus
the KL divergence between the full-cache and the compressed-cache next-token distributions.

* ``features.py``: per-entry, per-KV-head features from :class:`~kvsieve.signals.Signals`.
* ``network.py``: the keep-logit MLP, shared across layers and heads, with a layer embedding.
* ``policy.py``: :class:`LearnedPolicy`, registry name ``learned``; checkpoint loading and checks.
* ``sampling.py``: Gumbel-top-k / Plackett-Luce keep sets with an exact log-probability.
* ``reward.py``: teacher (full-cache) distributions and the per-position KL.
* ``train.py``: :class:`TrainConfig` and :func:`train` (``kvsieve train``).
"""
