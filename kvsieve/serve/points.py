"""Which operating point a request runs: the contract's for its bucket, a fixed one, or full KV.

A client may ask for full KV (``kvsieve.full_kv``) or a stricter point (a lower ratio of the same policy),
never a looser one than the server's point, unless the server was started with ``--allow-override``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.policies import from_spec, parse_spec
from kvsieve.risk.runtime import CertifiedPolicy, OperatingPoint
from kvsieve.serve.errors import APIError
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
        return not self.point.fell_back and self.point.ratio > 0


def _full(bucket: str, reason: str) -> OperatingPoint:
    return OperatingPoint("full", 0.0, False, bucket, True, reason)


def _same_policy(a: str, b: str) -> bool:
    try:
        return parse_spec(a) == parse_spec(b)
    except (ValueError, SyntaxError):
        return False


class PointSource:
    """The server-wide source of operating points (exactly one of contract, fixed point, full KV)."""

    def __init__(self, certified: CertifiedPolicy | None = None, policy: str | None = None, ratio: float = 0.0,
                 question_aware: bool = False, allow_override: bool = False) -> None:
        if certified is not None and policy is not None:
            raise ValueError("give a contract or a fixed policy, not both")
        if policy is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
                raise ValueError(f"ratio must be in [0, 1), got {ratio!r}")
            from_spec(policy)  # an unknown policy fails at start, not on the first request
        self.certified = certified
        self.policy, self.ratio, self.question_aware = policy, float(ratio), question_aware
        self.allow_override = allow_override

    @property
    def kind(self) -> str:
        return "contract" if self.certified else "policy" if self.policy else "full"

    def base(self, task: str | None, context_tokens: int) -> ChosenPoint:
        if self.certified is not None:
            by = self.certified.contract.by
            if by in ("task", "task_family") and task is None:
                return ChosenPoint(_full("-", f"the contract is conditional on the {by.replace('_', ' ')}: "
                                              "name it in the request (extra_body={'kvsieve': {'task': ...}})"),
                                   "fallback")
            point = self.certified.operating_point(task, context_tokens)
            return ChosenPoint(point, "fallback" if point.fell_back else "certified")
        if self.policy is not None and self.ratio > 0:
            return ChosenPoint(OperatingPoint(self.policy, self.ratio, self.question_aware, "-", False), "uncertified")
        return ChosenPoint(_full("-", "the server runs full KV (no contract, no policy)"), "full")

    def choose(self, options: KvsieveOptions, context_tokens: int) -> ChosenPoint:
        base = self.base(options.task, context_tokens)
        if options.full_kv:
            return ChosenPoint(_full(base.point.bucket, "the client asked for full KV"), "full_requested")
        if options.ratio is None and options.policy is None:
            return base
        ratio = options.ratio
        if ratio is not None and not 0 <= ratio < 1:
            raise APIError(400, f"kvsieve.ratio {ratio!r} is out of range: a compression ratio is in [0, 1)",
                           "kvsieve.ratio")
        here = base.point
        policy = options.policy or (here.policy_spec if not here.fell_back else None)
        if policy is None:
            raise APIError(400, "kvsieve.ratio needs kvsieve.policy here: this request's point is full KV",
                           "kvsieve.policy")
        try:
            from_spec(policy)
        except ValueError as err:
            raise APIError(400, f"kvsieve.policy {policy!r}: {err}", "kvsieve.policy") from err
        ratio = here.ratio if ratio is None else float(ratio)
        same = not here.fell_back and _same_policy(policy, here.policy_spec)
        stricter = same and ratio <= here.ratio
        if not stricter and not self.allow_override:
            allowed = (f"full KV, or {here.policy_spec} at a ratio <= {here.ratio:g}" if not here.fell_back
                       else "full KV only")
            current = "full KV" if here.fell_back else f"{here.policy_spec}@{here.ratio:g}"
            raise APIError(400, f"kvsieve point {policy}@{ratio:g} is looser than this request's {base.status} point "
                                f"({current}, bucket {here.bucket}); allowed: {allowed} "
                                "(or start the server with --allow-override)", "kvsieve")
        if ratio == 0:
            return ChosenPoint(_full(here.bucket, "the client asked for ratio 0"), "full_requested")
        qa = here.question_aware if same else False
        point = OperatingPoint(policy, ratio, qa, here.bucket, False, f"the client asked for {policy}@{ratio:g}")
        return ChosenPoint(point, "stricter" if stricter else "override")
