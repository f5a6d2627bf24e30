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
from kvsieve.policies import Policy, PolicySpec
from kvsieve.policies.label import FULL_CACHE, Mode, Point
from kvsieve.policy import FullCache
from kvsieve.prompt import build_prompt
from kvsieve.risk.contract import ContractFile
from kvsieve.risk.losses import length_bucket
from kvsieve.tasks import task_family

__all__ = ["OperatingPoint", "CertifiedPolicy", "CertifiedSession"]


@dataclass(frozen=True)
class OperatingPoint:
    """What to run for one request: a built policy (model-checked once, shared by every request of the point)
    at a ratio. ``spec is None`` (and ``fell_back``, or ratio 0) means full KV."""

    spec: PolicySpec | None
    policy: Policy
    ratio: float
    question_aware: bool
    bucket: str
    fell_back: bool
    reason: str = ""
    chunk_size: int = 0  # decode-time eviction's chunk (a ``SPEC@decodeN`` point); 0: prefill compression

    @classmethod
    def full(cls, bucket: str, reason: str, fell_back: bool = True) -> OperatingPoint:
        return cls(None, FullCache(), 0.0, False, bucket, fell_back, reason)

    @property
    def policy_spec(self) -> str:
        """The spec text of what runs: ``full`` for full KV."""
        return FULL_CACHE if self.spec is None or self.fell_back else self.spec.text

    @property
    def point(self) -> Point:
        """What runs, as a :class:`~kvsieve.policies.label.Point`: full KV at ratio 0 when it fell back."""
        if self.spec is None or self.fell_back:
            return Point(FULL_CACHE)
        return Point(self.spec, self.ratio, self.question_aware, Mode(self.chunk_size))

    @property
    def compresses(self) -> bool:
        """Whether anything is evicted (the point's budget; serve reads it by this name)."""
        return self.point.budget is not None

    @property
    def protects_question(self) -> bool:
        return self.point.protects_question

    def __str__(self) -> str:
        if not self.compresses:
            return f"full KV (bucket {self.bucket}{': ' + self.reason if self.reason else ''})"
        qa = ", question-aware" if self.question_aware else ""
        return f"{self.policy_spec}@{self.ratio:g} (bucket {self.bucket}{qa})"

    def protected_tail(self, question_tokens: int) -> int:
        """Tokens kept on top of the budget: the question, when the point was certified question-aware."""
        if isinstance(question_tokens, bool) or not isinstance(question_tokens, int) or question_tokens < 0:
            raise ValueError(f"question_tokens must be an int >= 0, got {question_tokens!r}")
        return question_tokens if self.protects_question else 0

    @contextlib.contextmanager
    def attach(self, model, question_tokens: int) -> Iterator[Session]:
        """``kvsieve.attach`` at this point. A question-aware point compresses the first forward (context and
        question together) keeping its last ``question_tokens``; a query-agnostic one compresses the context
        alone (feed the question in a second forward)."""
        mode = dict(mode="decode", chunk_size=self.chunk_size) if self.chunk_size and self.compresses else {}
        with attach(model, self.policy, ratio=self.ratio if self.compresses else 0.0,
                    protected_tail=self.protected_tail(question_tokens), **mode) as s:
            yield s


@dataclass
class CertifiedSession:
    """What :meth:`CertifiedPolicy.attach` yields: the request's point and the engine session."""

    point: OperatingPoint
    session: Session

    @property
    def prefill_question(self) -> bool:
        """Whether the first forward must be context + question (question-aware) or the context alone."""
        return self.point.protects_question


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
        return OperatingPoint(self.specs[chosen.spec], self.policies[chosen.spec], chosen.ratio, chosen.question_aware,
                              bucket, False, chunk_size=chosen.chunk_size)

    @contextlib.contextmanager
    def attach(self, model, question_tokens: int, task: str | None = None,
               context_tokens: int | None = None) -> Iterator[CertifiedSession]:
        """``kvsieve.attach`` at the request's certified point (prefill compression).

        ``question_tokens`` is the length of the prompt's question part. When the point is question-aware
        (``yielded.prefill_question``) run context + question as the first forward: the question is kept on
        top of the budget, as it was when the point was certified. Otherwise run the context first.
        """
        point = self.operating_point(task, context_tokens)
        with point.attach(model, question_tokens) as session:
            yield CertifiedSession(point, session)

    def generate(self, model, tokenizer, context: str, question: str, task: str | None = None,
                 model_name: str | None = None, **options) -> Generation:
        """``kvsieve.engine.generate.generate`` at the request's certified point, question-awareness included.

        The point's policy is the one built when the contract was read, checked against ``model`` on the first
        call (``model_name``: the name it was loaded under; default the contract's)."""
        self.bind(model, model_name)
        context_tokens = build_prompt(tokenizer, context, question, options.get("answer_prefix", "")).context_ids
        point = self.operating_point(task, int(context_tokens.shape[1]))
        if point.chunk_size and point.compresses:
            options = dict(options, mode="decode", chunk_size=point.chunk_size)
        return generate(model, tokenizer, context, question, point.policy, ratio=point.ratio,
                        question_aware=point.protects_question, **options)
