"""Policies: one file per family with its paper; the registry (``registry.py``) lists and builds them.

``kvsieve.policies.get(name, **params)`` builds a policy, ``parse(spec)`` reads a spec string once,
``names()`` and ``families()`` list every family a user can call.
"""

from __future__ import annotations

from kvsieve.policies.adakv import AdaKV
from kvsieve.policies.chunkkv import ChunkKV
from kvsieve.policies.expected_attention import ExpectedAttention
from kvsieve.policies.frc import FRC
from kvsieve.policies.h2o import H2O
from kvsieve.policies.knorm import KNorm
from kvsieve.policies.kvzap import KVzap
from kvsieve.policies.kvzip import KVzip
from kvsieve.policies.learned import LearnedPolicy
from kvsieve.policies.oracle import Oracle
from kvsieve.policies.program import ProgramPolicy
from kvsieve.policies.pyramidkv import PyramidKV
from kvsieve.policies.random import RandomPolicy
from kvsieve.policies.registry import PolicySpec, families, from_spec, get, names, parse, register
from kvsieve.policies.snapkv import SnapKV
from kvsieve.policies.streaming_llm import StreamingLLM
from kvsieve.policies.tova import TOVA
from kvsieve.policy import FullCache, Policy
from kvsieve.spec import parse_spec, split_specs

__all__ = ["Policy", "PolicySpec", "parse", "get", "names", "families", "register", "from_spec", "parse_spec",
           "split_specs"]

for _cls in (FullCache, RandomPolicy, StreamingLLM, KNorm, SnapKV, TOVA, H2O, ExpectedAttention, PyramidKV, AdaKV,
             ChunkKV, FRC, Oracle, KVzip, ProgramPolicy, LearnedPolicy, KVzap):
    register(_cls)
