"""Full cache: no compression. The reference every other policy is measured against."""

import torch

from kvsieve.policies.base import Policy
from kvsieve.signals import Signals


class FullCache(Policy):
    """Keeps everything. Signal: none."""

    name = "full"
    uses_window = False
    compresses = False

    def score(self, signals: Signals) -> torch.Tensor:
        return torch.zeros(signals.batch_size, signals.num_kv_heads, signals.seq_len, device=signals.keys.device)
