"""Policy registry: ``get(name, **params)`` builds a policy, ``names()`` lists them."""

from __future__ import annotations

from kvsieve.learn.policy import LearnedPolicy
from kvsieve.policies.adakv import AdaKV
from kvsieve.policies.base import Policy
from kvsieve.policies.chunkkv import ChunkKV
from kvsieve.policies.expected_attention import ExpectedAttention
from kvsieve.policies.frc import FRC
from kvsieve.policies.full import FullCache
from kvsieve.policies.h2o import H2O
from kvsieve.policies.knorm import KNorm
from kvsieve.policies.kvzip import KVzip
from kvsieve.policies.oracle import Oracle
from kvsieve.policies.program import ProgramPolicy
from kvsieve.policies.pyramidkv import PyramidKV
from kvsieve.policies.random import RandomPolicy
from kvsieve.policies.snapkv import SnapKV
from kvsieve.policies.streaming_llm import StreamingLLM
from kvsieve.policies.tova import TOVA
from kvsieve.spec import parse_spec, split_specs

__all__ = ["Policy", "get", "names", "register", "from_spec", "parse_spec", "split_specs", "REFERENCE"]

# Reference lines for reports, never offered as policies for real use.
REFERENCE = ("oracle",)

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class under its ``name`` (usable as a decorator)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (FullCache, RandomPolicy, StreamingLLM, KNorm, SnapKV, TOVA, H2O, ExpectedAttention, PyramidKV, AdaKV,
             ChunkKV, FRC, Oracle):
    register(_cls)
register(KVzip)  # scores from a reconstruction forward: the engine and the runner compute them
register(ProgramPolicy)  # an evolved program file: "program:PATH"
register(LearnedPolicy)  # a trained network: "learned(checkpoint=PATH or shipped name)"


def names(include_reference: bool = False) -> list[str]:
    """Registered policy names; reference lines (``oracle``) only when asked; ``program`` and ``learned`` take a
    file (a path or checkpoint), so they are not listed as ready to build."""
    return sorted(n for n in _REGISTRY if (include_reference or n not in REFERENCE) and n not in ("program", "learned"))


def get(name: str, **params) -> Policy:
    """Build the policy registered as ``name``; unknown names and parameters raise ValueError."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(names(include_reference=True))}")
    try:
        return _REGISTRY[name](**params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from err


def from_spec(spec: str) -> Policy:
    """Build a policy from ``name``, ``name(key=value, ...)`` (``snapkv(window=32)``) or ``program:PATH``."""
    name, params = parse_spec(spec)
    return get(name, **params)
