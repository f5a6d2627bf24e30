"""TOVA: Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024, arXiv:2401.06104.

Signal: attention from the last query only, averaged over all heads of the layer (one ranking
shared by every KV head).
"""

import torch

from kvsieve.policies.base import Policy
from kvsieve.signals import Signals


class TOVA(Policy):
    name = "tova"

    def score(self, signals: Signals) -> torch.Tensor:
        last = signals.window_attention[:, :, -1, :].mean(dim=1, keepdim=True)
        return last.expand(-1, signals.num_kv_heads, -1)
