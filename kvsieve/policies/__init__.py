"""Policy registry: ``get(name, **params)`` builds a policy, ``names()`` lists them."""

from __future__ import annotations

from kvsieve.policies.adakv import AdaKV
from kvsieve.policies.base import Policy
from kvsieve.policies.chunkkv import ChunkKV
from kvsieve.policies.expected_attention import ExpectedAttention
from kvsieve.policies.full import FullCache
from kvsieve.policies.h2o import H2O
from kvsieve.policies.knorm import KNorm
from kvsieve.policies.pyramidkv import PyramidKV
from kvsieve.policies.random import RandomPolicy
from kvsieve.policies.snapkv import SnapKV
from kvsieve.policies.streaming_llm import StreamingLLM
from kvsieve.policies.tova import TOVA

__all__ = ["Policy", "get", "names", "register"]

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class under its ``name`` (usable as a decorator)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (FullCache, RandomPolicy, StreamingLLM, KNorm, SnapKV, TOVA, H2O, ExpectedAttention, PyramidKV, AdaKV,
             ChunkKV):
    register(_cls)


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str, **params) -> Policy:
    """Build the policy registered as ``name``; unknown names and parameters raise ValueError."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(names())}")
    try:
        return _REGISTRY[name](**params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from err
