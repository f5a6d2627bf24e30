"""Apply a contract at run time: the certified operating point for a request, or full KV."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvsieve.engine.attach import Session, attach
from kvsieve.policies import Policy, from_spec
from kvsieve.policies.full import FullCache
from kvsieve.risk.contract import ContractFile
from kvsieve.risk.losses import length_bucket
from kvsieve.tasks import task_family

__all__ = ["OperatingPoint", "CertifiedPolicy"]


@dataclass(frozen=True)
class OperatingPoint:
    """What to run for one request. ``ratio == 0`` and ``fell_back`` mean full KV."""

    policy_spec: str
    ratio: float
    question_aware: bool
    bucket: str
    fell_back: bool
    reason: str = ""

    @property
    def policy(self) -> Policy:
        return from_spec(self.policy_spec) if not self.fell_back else FullCache()


class CertifiedPolicy:
    """The runtime side of a contract file (see ``kvsieve certify``).

    >>> certified = CertifiedPolicy.from_contract("contract.json")
    >>> point = certified.operating_point(task="niah_single_1", context_tokens=4000)
    >>> generate(model, tokenizer, context, question, point.policy, ratio=point.ratio,
    ...          question_aware=point.question_aware)
    """

    def __init__(self, contract: ContractFile) -> None:
        self.contract = contract

    @classmethod
    def from_contract(cls, path: str | Path) -> CertifiedPolicy:
        return cls(ContractFile.read(path))

    def bucket_for(self, task: str | None = None, context_tokens: int | None = None) -> str:
        by = self.contract.by
        if by == "none":
            return "all"
        if by in ("task", "task_family"):
            if task is None:
                raise ValueError(f"this contract is conditional on the {by.replace('_', ' ')}: pass task=")
            return task if by == "task" else task_family(task)
        if context_tokens is None:
            raise ValueError("this contract is conditional on the context length: pass context_tokens=")
        return length_bucket(int(context_tokens), self.contract.length_edges)

    def operating_point(self, task: str | None = None, context_tokens: int | None = None) -> OperatingPoint:
        """The certified point of the request's bucket; full KV when it fell back or was never calibrated."""
        bucket = self.bucket_for(task, context_tokens)
        cert = self.contract.buckets.get(bucket)
        if cert is None:
            return OperatingPoint("full", 0.0, False, bucket, True, f"bucket {bucket!r} was not calibrated")
        if cert.chosen is None:
            return OperatingPoint("full", 0.0, False, bucket, True, cert.reason)
        chosen = cert.chosen
        return OperatingPoint(chosen.policy, chosen.ratio, chosen.question_aware, bucket, False)

    @contextlib.contextmanager
    def attach(self, model, task: str | None = None, context_tokens: int | None = None,
               protected_tail: int = 0) -> Iterator[Session]:
        """``kvsieve.attach`` with the request's certified operating point (prefill compression)."""
        point = self.operating_point(task, context_tokens)
        with attach(model, point.policy, ratio=point.ratio, protected_tail=protected_tail) as session:
            yield session
