"""Which point a request runs (:meth:`PointSource.decide`, the one decision): the contract's for its bucket, a
fixed one, the client's stricter choice, or full KV, with the reason.

A client may ask for full KV (``kvsieve.full_kv``) or a stricter point (a lower ratio of the same policy),
never a looser one than the server's point, unless the server was started with ``--allow-override``; even then
only among the points the server was started with (its contract's or ``--policy``), by their spec text. A prompt
too short for the point's policy runs at full KV, as does a request whose policy fails while its prompt is
compressed (``ChosenPoint.fallback``, the one way a fallback is built).

A request's point is a :class:`ChosenPoint`: an :class:`~kvsieve.policies.operating_point.OperatingPoint` (the
:class:`~kvsieve.policies.label.Point` that runs, its built policy, the bucket and a fallback's reason) and the status
below. The setting itself (ratio, question, whether it compresses, its mode: prefill compression, or decode-time
eviction reading the prompt in chunks and evicting every ``evict_every`` generated tokens) is only ever read from the
``Point``: a contract's point and a ``--policy`` point run their mode alike (``serve/decode_prefill.py``).
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

__all__ = ["STATUSES", "ChosenPoint", "PointSource", "name_of"]

# certified: the contract's point; fallback: full KV where a point was wanted (the contract says so for this bucket,
# the prompt is too short for it, or its policy failed); uncertified: --policy; full: no contract or policy;
# full_requested / stricter / override: the client's choice
STATUSES = ("certified", "fallback", "uncertified", "full", "full_requested", "stricter", "override")


@dataclass(frozen=True)
class ChosenPoint:
    """A request's point and its status."""

    point: OperatingPoint
    status: str

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
        """Whether the row evicts while it decodes: a decode-time point that compresses (``SPEC@decodeNeE``)."""
        return self.setting.mode.is_decode and self.setting.budget is not None

    @property
    def evict_every(self) -> int:
        """Generated tokens between the row's evictions, as the point records them (0: it never evicts then)."""
        return self.setting.evict_every if self.evicts_in_decode else 0

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
        """``policy``: a spec, or a label carrying its mode (``tova@decode64e32``: the prompt read 64 tokens at a
        time, evicted after each chunk and every 32 generated tokens); ``evict_every`` N > 0 makes a plain spec that
        decode-time point, ``SPEC@decodeNeN`` (evicting every N tokens, read or generated)."""
        if certified is not None and policy is not None:
            raise ValueError("give a contract or a fixed policy, not both")
        if isinstance(evict_every, bool) or not isinstance(evict_every, int) or evict_every < 0:
            raise ValueError(f"evict_every must be an int >= 0 (0: no decode-time eviction), got {evict_every!r}")
        self.fixed: OperatingPoint | None = None
        if policy is not None:
            label = Point(policy, ratio, question_aware, Mode(recall=recall))  # reads a label's mode
            mode = label.mode
            if evict_every and mode.is_decode and mode.evict_every != evict_every:
                raise ValueError(f"--policy {label.stored!r} evicts every {mode.evict_every} generated tokens, and "
                                 f"--evict-every {evict_every} was given too: give it once")
            if evict_every and mode.recall is not None:
                raise ValueError("a point with recall answers from its recalled copy as it is: it does not evict "
                                 "while it decodes (drop --evict-every or --recall)")
            if evict_every and not mode.is_decode:
                mode = Mode(evict_every, evict_every)
            spec = parse(label.spec)  # an unknown policy or a missing file fails at start, not on the first request
            point = Point(spec, ratio, question_aware, mode)  # the ratio, recall and mode are checked there
            if point.budget is not None:
                self.fixed = OperatingPoint(point, spec.build())
                _check_decode(self.fixed, "--policy")
        self.certified = certified
        self.policy = policy
        self.allow_override = allow_override
        # a point's client name -> (its point, the loosest ratio the server runs it at): what a client may name
        self.known: dict[str, tuple[OperatingPoint, float]] = {}
        if certified is not None:
            for cert in certified.contract.buckets.values():
                chosen = cert.chosen
                if chosen is None or chosen.budget is None:
                    continue
                point = OperatingPoint(Point(certified.specs[chosen.spec], chosen.ratio, chosen.question_aware,
                                             chosen.mode), certified.policies[chosen.spec])
                _check_decode(point, "the contract's point")
                text = name_of(point.point)
                loosest = max(chosen.ratio, self.known[text][1]) if text in self.known else chosen.ratio
                self.known[text] = (point, loosest)
        elif self.fixed is not None:
            self.known[name_of(self.fixed.point)] = (self.fixed, self.fixed.point.ratio)

    @property
    def evict_every(self) -> int:
        """Generated tokens between evictions of the fixed (``--policy``) point's rows; 0 when it has none."""
        fixed = self.fixed
        return fixed.point.evict_every if fixed is not None and fixed.point.mode.is_decode else 0

    @property
    def kind(self) -> str:
        return "contract" if self.certified else "policy" if self.policy else "full"

    @property
    def policies(self) -> dict[str, Policy]:
        """Every built policy a request may run, by spec text."""
        return {text: point.policy for text, (point, _) in self.known.items()}

    def bind(self, model, name: str | None = None) -> None:
        """Model-check every policy once, at start-up (binds a program's surrogate; refuses a checkpoint trained
        for another model)."""
        if self.certified is not None:
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
            return ChosenPoint(self.fixed, "uncertified")
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
        text = options.policy.strip() if options.policy is not None else (name_of(here) if here.compresses else None)
        if text is None:
            raise APIError(400, "kvsieve.ratio needs kvsieve.policy here: this request's point is full KV; allowed "
                                f"policies: {self.allowed()}", "kvsieve.policy")
        if text not in self.known:
            raise APIError(400, f"kvsieve.policy {quoted(text)} is not a point this server runs; allowed: "
                                f"{self.allowed()}, or kvsieve.full_kv", "kvsieve.policy")
        same = here.compresses and text == name_of(here)
        stricter = same and ratio <= here.ratio
        if not stricter and not self.allow_override:
            allowed = f"full KV, or {name_of(here)} at a ratio <= {here.ratio:g}" if here.compresses else "full KV only"
            current = f"{name_of(here)}@{here.ratio:g}" if here.compresses else "full KV"
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
        return ChosenPoint(chosen, "stricter" if stricter else "override")


def name_of(point: Point) -> str:
    """What a client names a point by (``kvsieve.policy``): its spec, with the mode of a decode-time point
    (``tova@decode64e32``), so a contract's prefill and decode-time points of one policy stay apart."""
    return point.stored if point.mode.is_decode else point.spec


def _check_decode(point: OperatingPoint, what: str) -> None:
    """Refuse, at start, a decode-time point whose policy the decode batch cannot evict (it reads what the batch does
    not keep: ``serve/decode_eviction.evicts_in_decode``)."""
    if point.point.mode.is_decode and not evicts_in_decode(point.policy):
        raise ValueError(f"{what} {point.point} evicts while it decodes, but its policy reads what the server's decode "
                         "batch does not keep (accumulated attention, query statistics, hidden states, a repeat of "
                         "the context, or a recent share of the budget): serve a prefill point of it, or another "
                         "policy")


def _feasible(chosen: ChosenPoint, prompt: Prompt) -> ChosenPoint:
    """Full KV, with the reason, when the prompt is too short for the point's policy to compress it (a decode-time
    point reads its prompt in chunks, as the grid does: its window is not checked against the context)."""
    if not chosen.setting.compresses:
        return chosen
    setting, policy = chosen.setting, chosen.point.policy
    n, m = prompt.context_ids.shape[1], prompt.question_ids.shape[1]
    first = n + m if setting.protects_question else n
    if policy.uses_window and first < policy.window and not setting.mode.is_decode:
        return chosen.fallback(f"the prompt's compressed part ({first} tokens) is shorter than {setting.spec}'s "
                               f"window ({policy.window})")
    if n < 2:
        return chosen.fallback(f"the context ({n} tokens) is too short to compress")
    return chosen
