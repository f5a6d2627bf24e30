"""Which operating point a request runs: the contract's for its bucket, a fixed one, or full KV.

A client may ask for full KV (``kvsieve.full_kv``) or a stricter point (a lower ratio of the same policy),
never a looser one than the server's point, unless the server was started with ``--allow-override``; even then
only among the points the server was started with (its contract's or ``--policy``), by their spec text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvsieve.policies import Policy, parse
from kvsieve.policies.label import DECODE
from kvsieve.risk.runtime import CertifiedPolicy, OperatingPoint
from kvsieve.serve.errors import APIError, quoted
from kvsieve.serve.schemas import KvsieveOptions

__all__ = ["STATUSES", "ChosenPoint", "PointSource"]

# certified: the contract's point; fallback: the contract says full KV for this bucket; uncertified: --policy;
# full: no contract or policy; full_requested / stricter / override: the client's choice
STATUSES = ("certified", "fallback", "uncertified", "full", "full_requested", "stricter", "override")


@dataclass(frozen=True)
class ChosenPoint:
    point: OperatingPoint
    status: str

    @property
    def certified(self) -> bool:
        return self.status == "certified"

    @property
    def compresses(self) -> bool:
        return self.point.compresses


def _full(bucket: str, reason: str) -> OperatingPoint:
    return OperatingPoint.full(bucket, reason)


class PointSource:
    """The server-wide source of operating points (exactly one of contract, fixed point, full KV).

    Every policy a request can run is parsed, digest-checked and built here, once, and model-checked by
    :meth:`bind` when the model is loaded; a request only selects among these by their spec text. A client's
    ``kvsieve.policy`` is never parsed (parsing a ``program:PATH`` or ``learned(checkpoint=PATH)`` would open
    the path): it must be the text of one of the server's points.
    """

    def __init__(self, certified: CertifiedPolicy | None = None, policy: str | None = None, ratio: float = 0.0,
                 question_aware: bool = False, allow_override: bool = False) -> None:
        if certified is not None and policy is not None:
            raise ValueError("give a contract or a fixed policy, not both")
        self.fixed: OperatingPoint | None = None
        if policy is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
                raise ValueError(f"ratio must be in [0, 1), got {ratio!r}")
            spec = parse(policy)  # an unknown policy or a missing file fails at start, not on the first request
            self.fixed = OperatingPoint(spec, spec.build(), float(ratio), question_aware, "-", False)
        self.certified = certified
        self.policy, self.ratio, self.question_aware = policy, float(ratio), question_aware
        self.allow_override = allow_override
        # spec text -> (its point, the loosest ratio the server runs it at): what a client may name
        self.known: dict[str, tuple[OperatingPoint, float]] = {}
        if certified is not None:
            for cert in certified.contract.buckets.values():
                if cert.chosen is None:
                    continue
                text = cert.chosen.spec
                point = OperatingPoint(certified.specs[text], certified.policies[text], cert.chosen.ratio,
                                       cert.chosen.question_aware, "-", False)
                loosest = max(cert.chosen.ratio, self.known[text][1]) if text in self.known else cert.chosen.ratio
                self.known[text] = (point, loosest)
        elif self.fixed is not None and self.fixed.ratio > 0:
            self.known[self.fixed.spec.text] = (self.fixed, self.fixed.ratio)

    @property
    def kind(self) -> str:
        return "contract" if self.certified else "policy" if self.policy else "full"

    @property
    def policies(self) -> dict[str, Policy]:
        """Every built policy a request may run, by spec text."""
        return {text: point.policy for text, (point, _) in self.known.items()}

    def bind(self, model, name: str | None = None) -> None:
        """Model-check every policy once, at start-up (binds a program's surrogate; refuses a checkpoint trained
        for another model). Prefill compression only: a decode-time point is refused here."""
        if self.certified is not None:
            decode = [c.chosen.policy for c in self.certified.contract.buckets.values()
                      if c.chosen is not None and c.chosen.mode == DECODE]
            if decode:
                raise ValueError(f"the contract certifies decode-time eviction ({decode[0]}); kvsieve serve runs "
                                 "prefill compression: certify prefill candidates for serving")
            self.certified.bind(model, name)
        elif self.fixed is not None:
            try:
                self.fixed.policy.check_model(model, name)
            except ValueError as err:
                raise ValueError(f"--policy {self.fixed.spec.text!r} cannot run on this model: {err}") from None

    def base(self, task: str | None, context_tokens: int) -> ChosenPoint:
        if self.certified is not None:
            by = self.certified.contract.by
            if by in ("task", "task_family") and task is None:
                return ChosenPoint(_full("-", f"the contract is conditional on the {by.replace('_', ' ')}: "
                                              "name it in the request (extra_body={'kvsieve': {'task': ...}})"),
                                   "fallback")
            if by in ("task", "task_family"):
                self.check_task(task)
            point = self.certified.operating_point(task, context_tokens)
            return ChosenPoint(point, "fallback" if point.fell_back else "certified")
        if self.fixed is not None and self.fixed.ratio > 0:
            return ChosenPoint(self.fixed, "uncertified")
        return ChosenPoint(_full("-", "the server runs full KV (no contract, no policy)"), "full")

    def check_task(self, task: str) -> None:
        """A task routes a request only to one of the contract's own buckets (its name then appears in headers and
        metrics, never the client's text): anything else is refused, naming what is allowed."""
        contract = self.certified.contract
        bucket = self.certified.bucket_for(task) if len(task) <= 200 and task.isprintable() else None
        if bucket not in contract.buckets:
            kind = "task" if contract.by == "task" else "task whose family is"
            raise APIError(400, f"kvsieve.task {quoted(task)} is not in this server's contract; allowed: a {kind} one "
                                f"of {', '.join(sorted(contract.buckets))}", "kvsieve.task")

    def allowed(self) -> str:
        """What a client may name, for error messages."""
        points = [f"{text} (ratio <= {loosest:g})" for text, (_, loosest) in self.known.items()]
        return ", ".join(points) if points else "none (this server runs full KV)"

    def choose(self, options: KvsieveOptions, context_tokens: int) -> ChosenPoint:
        base = self.base(options.task, context_tokens)
        if options.full_kv:
            return ChosenPoint(_full(base.point.bucket, "the client asked for full KV"), "full_requested")
        if options.ratio is None and options.policy is None:
            return base
        ratio = options.ratio
        if ratio is not None and (not math.isfinite(ratio) or not 0 <= ratio < 1):
            raise APIError(400, f"kvsieve.ratio {ratio!r} is out of range: a compression ratio is in [0, 1)",
                           "kvsieve.ratio")
        here = base.point
        text = options.policy.strip() if options.policy is not None else (None if here.fell_back else
                                                                           here.policy_spec)
        if text is None:
            raise APIError(400, "kvsieve.ratio needs kvsieve.policy here: this request's point is full KV; allowed "
                                f"policies: {self.allowed()}", "kvsieve.policy")
        if text not in self.known:
            raise APIError(400, f"kvsieve.policy {quoted(text)} is not a point this server runs; allowed: "
                                f"{self.allowed()}, or kvsieve.full_kv", "kvsieve.policy")
        ratio = here.ratio if ratio is None else float(ratio)
        same = not here.fell_back and text == here.policy_spec
        stricter = same and ratio <= here.ratio
        if not stricter and not self.allow_override:
            allowed = (f"full KV, or {here.policy_spec} at a ratio <= {here.ratio:g}" if not here.fell_back
                       else "full KV only")
            current = "full KV" if here.fell_back else f"{here.policy_spec}@{here.ratio:g}"
            raise APIError(400, f"kvsieve point {text}@{ratio:g} is looser than this request's {base.status} point "
                                f"({current}, bucket {here.bucket}); allowed: {allowed} "
                                "(or start the server with --allow-override)", "kvsieve")
        if ratio == 0:
            return ChosenPoint(_full(here.bucket, "the client asked for ratio 0"), "full_requested")
        template = self.known[text][0]
        point = replace(template, ratio=ratio, question_aware=template.question_aware and same, bucket=here.bucket,
                        reason=f"the client asked for {text}@{ratio:g}")
        return ChosenPoint(point, "stricter" if stricter else "override")
