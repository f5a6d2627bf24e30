"""Random eviction: the floor any informed policy must beat."""

import torch

from kvsieve.policy import Policy
from kvsieve.signals import Signals


class RandomPolicy(Policy):
    """Signal: none; uniform random scores, seeded per layer so runs repeat."""

    name = "random"
    uses_window = False

    def __init__(self, seed: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seed = seed

    def score(self, signals: Signals) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + signals.layer_idx)
        shape = (signals.batch_size, signals.num_kv_heads, signals.seq_len)
        return torch.rand(shape, generator=generator).to(signals.keys.device)
