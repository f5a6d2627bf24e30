"""The keep network: features of one cached entry -> a keep logit.

DistillCache's policy is "a lightweight policy network" (paper abstract); the issue asks for tens of
thousands of parameters at most, shared across layers and heads. Here: a learned embedding of the
layer index (up to ``max_layers`` layers) is concatenated to the float features, and a two-hidden-layer
MLP maps them to one logit per entry. Every entry is scored independently (the selection, top-k per
head, makes the entries compete), so one forward is a batched matmul over (b, h, n) entries, which
keeps the per-step overhead small. With the defaults (hidden 64, embedding 8, 64 layers) it has
5,953 parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from kvsieve.networks.keep_features import NUM_FLOAT_FEATURES

__all__ = ["NetConfig", "KeepNet"]


@dataclass(frozen=True)
class NetConfig:
    hidden: int = 64
    embed: int = 8
    max_layers: int = 64
    num_features: int = NUM_FLOAT_FEATURES

    def __post_init__(self) -> None:
        for name in ("hidden", "embed", "max_layers", "num_features"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NetConfig.{name} must be a positive int, got {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)


class KeepNet(nn.Module):
    """(..., num_features + 1) features, the last one the layer index -> (...) keep logits."""

    def __init__(self, config: NetConfig | None = None) -> None:
        super().__init__()
        self.config = config or NetConfig()
        c = self.config
        self.layer_embedding = nn.Embedding(c.max_layers, c.embed)
        self.mlp = nn.Sequential(
            nn.Linear(c.num_features + c.embed, c.hidden),
            nn.SiLU(),
            nn.Linear(c.hidden, c.hidden),
            nn.SiLU(),
            nn.Linear(c.hidden, 1),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        c = self.config
        if features.shape[-1] != c.num_features + 1:
            raise ValueError(f"expected {c.num_features + 1} feature columns, got {features.shape[-1]}")
        layer = features[..., -1].long()
        if int(layer.max()) >= c.max_layers or int(layer.min()) < 0:
            raise ValueError(f"layer index {int(layer.max())} is outside the network's {c.max_layers} layer embeddings")
        x = torch.cat([features[..., :-1], self.layer_embedding(layer)], dim=-1)
        return self.mlp(x).squeeze(-1)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
