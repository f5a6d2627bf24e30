"""Which point a request runs (:meth:`PointSource.decide`, the one decision): the contract's for its bucket, a
fixed one, the client's stricter choice, or full KV, with the reason.

A client may ask for full KV (``kvsieve.full_kv``) or a stricter point (a lower ratio of the same policy),
never a looser one than the server's point, unless the server was started with ``--allow-override``; even then
only among the points the server was started with (its contract's or ``--policy``), by their spec text. A prompt
too short for the point's policy runs at full KV, as does a request whose policy fails while its prompt is
compressed (``ChosenPoint.fallback``, the one way a fallback is built).

A request's point is a :class:`ChosenPoint`: an :class:`~kvsieve.policies.operating_point.OperatingPoint` (the
:class:`~kvsieve.policies.label.Point` that runs, its built policy, the bucket and a fallback's reason), the status
below, and whether its row also evicts while it decodes (``evict_every``). The setting itself (ratio, question,
whether it compresses) is only ever read from the ``Point``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.policies import Policy, parse
from kvsieve.policies.label import FULL_CACHE, Mode, Point
from kvsieve.policies.operating_point import OperatingPoint
from kvsieve.prompt import Prompt
from kvsieve.recall import Recall
from kvsieve.risk.runtime import CertifiedPolicy
from kvsieve.serve.decode_eviction import evicts_in_decode
from kvsieve.serve.errors import APIError, quoted
from kvsieve.serve.schemas import KvsieveOptions

__all__ = ["STATUSES", "ChosenPoint", "PointSource"]

# certified: the contract's point; fallback: full KV where a point was wanted (the contract says so for this bucket,
# the prompt is too short for it, or its policy failed); uncertified: --policy; full: no contract or policy;
# full_requested / stricter / override: the client's choice
STATUSES = ("certified", "fallback", "uncertified", "full", "full_requested", "stricter", "override")


@dataclass(frozen=True)
class ChosenPoint:
    """A request's point and its status; ``evict_every`` > 0: its row also evicts while it decodes, every that many
    steps (``serve/decode_eviction.py``), when its policy can."""

    point: OperatingPoint
    status: str
    evict_every: int = 0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")

    @property
    def setting(self) -> Point:
        """The point that runs (full KV when it fell back)."""
        return self.point.point

    @property
    def certified(self) -> bool:
        return self.status == "certified"

    @property
    def evicts_in_decode(self) -> bool:
        return self.evict_every > 0 and self.setting.compresses and evicts_in_decode(self.point.policy)

    def room(self, max_tokens: int) -> int:
        """Entries of room a request's segments get once its prompt is read: ``evict_every`` for a row that evicts
        while it decodes and would generate more than that, else ``max_tokens``."""
        return self.evict_every if self.evicts_in_decode and max_tokens > self.evict_every else max_tokens

    def fallback(self, reason: str) -> ChosenPoint:
        """Full KV in this point's bucket, answered as ``fallback`` with ``reason``: the one way one is built."""
        return ChosenPoint(OperatingPoint.full(self.point.bucket, reason[:500]), "fallback")


def _full(bucket: str, reason: str, status: str) -> ChosenPoint:
    return ChosenPoint(OperatingPoint.full(bucket, reason), status)


class PointSource:
    """The server-wide source of operating points (exactly one of contract, fixed point, full KV).

    Every policy a request can run is parsed, digest-checked and built here, once, and model-checked by
    :meth:`bind` when the model is loaded; a request only selects among these by their spec text. A client's
    ``kvsieve.policy`` is never parsed (parsing a ``program:PATH`` or ``learned(checkpoint=PATH)`` would open
    the path): it must be the text of one of the server's points.
    """

    def __init__(self, certified: CertifiedPolicy | None = None, policy: str | None = None, ratio: float = 0.0,
                 question_aware: bool = False, allow_override: bool = False, evict_every: int = 0,
                 recall: Recall | None = None) -> None:
        if certified is not None and policy is not None:
            raise ValueError("give a contract or a fixed policy, not both")
        if isinstance(evict_every, bool) or not isinstance(evict_every, int) or evict_every < 0:
            raise ValueError(f"evict_every must be an int >= 0 (0: no decode-time eviction), got {evict_every!r}")
        self.fixed: OperatingPoint | None = None
        if policy is not None:
            spec = parse(policy)  # an unknown policy or a missing file fails at start, not on the first request
            point = Point(spec, ratio, question_aware, Mode(recall=recall))  # the ratio and recall are checked there
            if point.budget is not None:
                self.fixed = OperatingPoint(point, spec.build())
        self.certified = certified
        self.policy = policy
        self.allow_override = allow_override
        # decode-time eviction for --policy points only: a contract certified prefill compression, with the cache
        # growing during decoding, and its guarantee says nothing of evicting generated tokens
        # and a point with recall answers from its recalled copy as it is
        self.evict_every = evict_every if certified is None and recall is None else 0
        # spec text -> (its point, the loosest ratio the server runs it at): what a client may name
        self.known: dict[str, tuple[OperatingPoint, float]] = {}
        if certified is not None:
            for cert in certified.contract.buckets.values():
                chosen = cert.chosen
                if chosen is None or chosen.budget is None:
                    continue
                text = chosen.spec
                point = OperatingPoint(Point(certified.specs[text], chosen.ratio, chosen.question_aware, chosen.mode),
                                       certified.policies[text])
                loosest = max(chosen.ratio, self.known[text][1]) if text in self.known else chosen.ratio
                self.known[text] = (point, loosest)
        elif self.fixed is not None:
            self.known[self.fixed.point.spec] = (self.fixed, self.fixed.point.ratio)

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
                      if c.chosen is not None and c.chosen.chunk_size]
            if decode:
                raise ValueError(f"the contract certifies decode-time eviction ({decode[0]}); kvsieve serve runs "
                                 "prefill compression: certify prefill candidates for serving")
            self.certified.bind(model, name)
        elif self.fixed is not None:
            try:
                self.fixed.policy.check_model(model, name)
            except ValueError as err:
                raise ValueError(f"--policy {self.fixed.point.spec!r} cannot run on this model: {err}") from None

    # -- the decision -------------------------------------------------------------------------------------------
    def decide(self, options: KvsieveOptions, prompt: Prompt) -> ChosenPoint:
        """The point a request runs: the server's for its bucket, the client's choice among the server's points, or
        full KV (the prompt too short for the point's policy); a choice the client may not make is a 400."""
        return _feasible(self._choose(options, prompt.context_ids.shape[1]), prompt)

    def base(self, task: str | None, context_tokens: int) -> ChosenPoint:
        if self.certified is not None:
            by = self.certified.contract.by
            if by in ("task", "task_family") and task is None:
                return _full("-", f"the contract is conditional on the {by.replace('_', ' ')}: name it in the "
                                  "request (extra_body={'kvsieve': {'task': ...}})", "fallback")
            if by in ("task", "task_family"):
                self.check_task(task)
            point = self.certified.operating_point(task, context_tokens)
            return ChosenPoint(point, "fallback" if point.fell_back else "certified")
        if self.fixed is not None:
            return ChosenPoint(self.fixed, "uncertified", self.evict_every)
        return _full("-", "the server runs full KV (no contract, no policy)", "full")

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

    def _choose(self, options: KvsieveOptions, context_tokens: int) -> ChosenPoint:
        base = self.base(options.task, context_tokens)
        here = base.setting
        if options.full_kv:
            return _full(base.point.bucket, "the client asked for full KV", "full_requested")
        if options.ratio is None and options.policy is None:
            return base
        ratio = here.ratio
        if options.ratio is not None:
            try:  # the ratio is checked where every ratio is, by Point
                ratio = Point(FULL_CACHE, options.ratio).ratio
            except ValueError:
                raise APIError(400, f"kvsieve.ratio {options.ratio!r} is out of range: a compression ratio is in "
                                    "[0, 1)", "kvsieve.ratio") from None
        text = options.policy.strip() if options.policy is not None else (here.spec if here.compresses else None)
        if text is None:
            raise APIError(400, "kvsieve.ratio needs kvsieve.policy here: this request's point is full KV; allowed "
                                f"policies: {self.allowed()}", "kvsieve.policy")
        if text not in self.known:
            raise APIError(400, f"kvsieve.policy {quoted(text)} is not a point this server runs; allowed: "
                                f"{self.allowed()}, or kvsieve.full_kv", "kvsieve.policy")
        same = here.compresses and text == here.spec
        stricter = same and ratio <= here.ratio
        if not stricter and not self.allow_override:
            allowed = f"full KV, or {here.spec} at a ratio <= {here.ratio:g}" if here.compresses else "full KV only"
            current = f"{here.spec}@{here.ratio:g}" if here.compresses else "full KV"
            raise APIError(400, f"kvsieve point {text}@{ratio:g} is looser than this request's {base.status} point "
                                f"({current}, bucket {base.point.bucket}); allowed: {allowed} "
                                "(or start the server with --allow-override)", "kvsieve")
        if ratio == 0:
            return _full(base.point.bucket, "the client asked for ratio 0", "full_requested")
        template = self.known[text][0]
        t = template.point
        point = Point(t.parsed or t.spec, ratio, t.question_aware and same, t.mode)
        reason = f"the client asked for {text}@{ratio:g}"
        chosen = OperatingPoint(point, template.policy, base.point.bucket, False, reason)
        return ChosenPoint(chosen, "stricter" if stricter else "override", self.evict_every)


def _feasible(chosen: ChosenPoint, prompt: Prompt) -> ChosenPoint:
    """Full KV, with the reason, when the prompt is too short for the point's policy to compress it."""
    if not chosen.setting.compresses:
        return chosen
    setting, policy = chosen.setting, chosen.point.policy
    n, m = prompt.context_ids.shape[1], prompt.question_ids.shape[1]
    first = n + m if setting.protects_question else n
    if policy.uses_window and first < policy.window:
        return chosen.fallback(f"the prompt's compressed part ({first} tokens) is shorter than {setting.spec}'s "
                               f"window ({policy.window})")
    if n < 2:
        return chosen.fallback(f"the context ({n} tokens) is too short to compress")
    return chosen
