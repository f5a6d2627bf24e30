"""Apply a contract at run time: the certified operating point for a request, or full KV."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvsieve.bundled import canonical_name
from kvsieve.engine.attach import Session, attach
from kvsieve.engine.generate import Generation, generate
from kvsieve.policies import Policy
from kvsieve.policies.label import Point
from kvsieve.policies.operating_point import OperatingPoint
from kvsieve.prompt import build_prompt
from kvsieve.risk.contract import ContractFile
from kvsieve.risk.losses import length_bucket
from kvsieve.tasks import task_family

__all__ = ["CertifiedPolicy", "CertifiedSession"]


@dataclass
class CertifiedSession:
    """What :meth:`CertifiedPolicy.attach` yields: the request's point and the engine session."""

    point: OperatingPoint
    session: Session

    @property
    def prefill_question(self) -> bool:
        """Whether the first forward must be context + question (question-aware) or the context alone."""
        return self.point.point.protects_question


class CertifiedPolicy:
    """The runtime side of a contract file (see ``kvsieve certify``).

    >>> certified = CertifiedPolicy.from_contract("contract.json", model="smollm2-135m-instruct")
    >>> g = certified.generate(model, tokenizer, context, question, task="niah_single_1")

    ``model`` is checked against the model the contract was certified for (aliases resolve); a contract
    says nothing about another model, so that is an error.
    """

    def __init__(self, contract: ContractFile, model: str | None = None, where: str = "the contract") -> None:
        self.contract = contract
        if model is not None:
            self.check_model(model)
        # every chosen point parsed, digest-checked and built once: a request only selects among them
        self.specs = contract.check_points(where)
        self.policies: dict[str, Policy] = {text: spec.build() for text, spec in self.specs.items()}
        self._bound: int | None = None  # id() of the live model the policies were checked against

    @classmethod
    def from_contract(cls, path: str | Path, model: str | None = None) -> CertifiedPolicy:
        return cls(ContractFile.read(path), model, where=f"contract {path}")

    def bind(self, model, name: str | None = None) -> None:
        """``check_model`` every built policy against the live ``model`` once (a learned checkpoint refuses
        another model; a program reading ``f.surrogate`` binds the model's shipped surrogate)."""
        if self._bound == id(model):
            return
        for text, policy in self.policies.items():
            try:
                policy.check_model(model, name or self.contract.model)
            except ValueError as err:
                raise ValueError(f"the contract's policy {text!r} cannot run on this model: {err}") from None
        self._bound = id(model)

    def check_model(self, model: str) -> None:
        if canonical_name(model) != canonical_name(self.contract.model):
            raise ValueError(f"the contract was certified for model {self.contract.model!r}, not {model!r}: "
                             "its guarantee does not carry over to another model; certify one for it")

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
        if self.contract.length_quantity != "context_tokens":
            warnings.warn("this contract's length buckets were calibrated on the nominal length, and a request is "
                          "routed on its context tokens: recertify with kvsieve certify to bucket both the same way",
                          stacklevel=2)
        return length_bucket(int(context_tokens), self.contract.length_edges)

    def operating_point(self, task: str | None = None, context_tokens: int | None = None) -> OperatingPoint:
        """The certified point of the request's bucket; full KV when it fell back or was never calibrated.

        ``context_tokens`` is the prompt's context part in tokens (``build_prompt(...).context_ids``), the
        quantity length buckets were certified on."""
        bucket = self.bucket_for(task, context_tokens)
        cert = self.contract.buckets.get(bucket)
        if cert is None:
            return OperatingPoint.full(bucket, f"bucket {bucket!r} was not calibrated")
        if cert.chosen is None:
            return OperatingPoint.full(bucket, cert.reason)
        chosen = cert.chosen
        if chosen.budget is None:  # certified at ratio 0: nothing is evicted
            return OperatingPoint.full(bucket, f"the certified point {chosen} evicts nothing", fell_back=False)
        point = Point(self.specs[chosen.spec], chosen.ratio, chosen.question_aware, chosen.mode)
        return OperatingPoint(point, self.policies[chosen.spec], bucket)

    @contextlib.contextmanager
    def attach(self, model, question_tokens: int, task: str | None = None,
               context_tokens: int | None = None) -> Iterator[CertifiedSession]:
        """``kvsieve.attach`` at the request's certified point, in its mode (prefill, or decode-time eviction).

        ``question_tokens`` is the length of the prompt's question part. When the point is question-aware
        (``yielded.prefill_question``) run context + question as the first forward: the question is kept on
        top of the budget, as it was when the point was certified. Otherwise run the context first.
        """
        chosen = self.operating_point(task, context_tokens)
        tail = chosen.protected_tail(question_tokens)
        with attach(model, chosen.policy, ratio=chosen.point.ratio, protected_tail=tail,
                    **chosen.point.engine_options) as session:
            yield CertifiedSession(chosen, session)

    def generate(self, model, tokenizer, context: str, question: str, task: str | None = None,
                 model_name: str | None = None, **options) -> Generation:
        """``kvsieve.engine.generate.generate`` at the request's certified point, question-awareness included.

        The point's policy is the one built when the contract was read, checked against ``model`` on the first
        call (``model_name``: the name it was loaded under; default the contract's)."""
        self.bind(model, model_name)
        context_tokens = build_prompt(tokenizer, context, question, options.get("answer_prefix", "")).context_ids
        chosen = self.operating_point(task, int(context_tokens.shape[1]))
        options = {**options, **chosen.point.engine_options}
        return generate(model, tokenizer, context, question, chosen.policy, ratio=chosen.point.ratio,
                        question_aware=chosen.point.protects_question, **options)

