"""KNorm: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
EMNLP 2024, arXiv:2406.11430.

Signal: key L2 norm; keys with a low norm tend to receive high attention, so they are kept.
"""

import torch

from kvsieve.policy import Policy
from kvsieve.signals import Signals


class KNorm(Policy):
    name = "knorm"
    uses_window = False

    def score(self, signals: Signals) -> torch.Tensor:
        return -signals.key_norms
