"""Learned eviction (DistillCache): a small policy network over per-entry signals, trained with REINFORCE.

DistillCache (the paper's abstract) casts KV-cache eviction as a sequential
decision problem: a lightweight network reads internal model signals (attention statistics, value
norms, entropy, position) and decides what to evict; REINFORCE trains it on a per-step reward, minus
the KL divergence between the full-cache and the compressed-cache next-token distributions.

Training only: the network and its features are :mod:`kvsieve.networks.keep_net` and
:mod:`kvsieve.networks.keep_features`, the policy :mod:`kvsieve.policies.learned`; ``train.py`` is ``kvsieve train``'s
entry point, and each file here names its one concept in its own docstring.
"""
