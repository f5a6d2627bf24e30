"""The registry of policy families, and the one parsed form of a policy spec (:class:`PolicySpec`).

A spec string (``snapkv``, ``snapkv(window=32)``, ``tova(allocation='layer')``, ``program:best.py``,
``learned(checkpoint='smollm2-135m-instruct')``) is parsed once, at the edge (a grid, a contract, the
server), into a :class:`PolicySpec`: its family's class, its literal parameters (checked against the
class's signature, without building anything) and, for a family defined by a file, that file's
sha256. A file given by its path whose bytes are a named program's or checkpoint's is given by that name in the
spec's text (:meth:`~kvsieve.policy.Policy.named_params`), the key its rows are stored under. Everything downstream
reads the spec's attributes (is it the reference, does it need the answer's spans or the whole context) instead of
comparing names.

Any field of :class:`~kvsieve.selection.Selection` that the family does not take itself composes with
the family's scores: ``tova(allocation='layer')`` is TOVA's scores under AdaKV's allocation,
``knorm(chunk_size=8)`` KNorm's under ChunkKV's chunks, ``snapkv(allocation='global',
normalization='zscore')`` SnapKV's ranked across the whole model (kvpress writes ``AdaKVPress(TOVAPress())``).
The fields replace those of the family's default selection.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvsieve.policy import Policy
from kvsieve.selection import Selection, check_allocation
from kvsieve.spec import format_spec, parse_spec

__all__ = ["PolicySpec", "parse", "register", "families", "family_class", "names", "get", "from_spec",
           "SELECTION_FIELDS"]

_REGISTRY: dict[str, type[Policy]] = {}
SELECTION_FIELDS = frozenset(f.name for f in fields(Selection))


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class under its ``name`` (usable as a decorator)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def _kind(cls: type[Policy]) -> str:
    if cls.is_reference:
        return "reference"
    if cls.content_paths.__func__ is not Policy.content_paths.__func__:
        return "file"
    return "policy"


def families() -> dict[str, str]:
    """Every family a user can call -> its kind: ``policy`` (ready to build), ``file`` (defined by a file:
    ``program:PATH``, ``learned(checkpoint=...)``) or ``reference`` (the answer-span oracle)."""
    return {name: _kind(cls) for name, cls in sorted(_REGISTRY.items())}


def family_class(name: str) -> type[Policy]:
    """The class registered as ``name``; ValueError naming the registered ones for an unknown name."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {_listing()}")
    return _REGISTRY[name]


def names(kinds: tuple[str, ...] = ("policy", "file", "reference")) -> list[str]:
    """Registered family names of the given kinds (all by default)."""
    return [name for name, kind in families().items() if kind in kinds]


def _listing() -> str:
    return ", ".join(f"{name}" + ("" if kind == "policy" else f" ({kind})") for name, kind in families().items())


@dataclass(frozen=True, eq=False)
class PolicySpec:
    """One parsed policy spec. Equal (and hashed) by its text, the label the results store keys rows by."""

    text: str
    family: str
    params: dict[str, Any] = field(default_factory=dict)
    digest: str | None = None  # sha256 of the files that define the policy (content_digest), else None
    cls: type[Policy] = Policy

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicySpec) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __str__(self) -> str:
        return self.text

    @property
    def needs_spans(self) -> bool:
        return self.cls.needs_spans

    @property
    def needs_whole_context(self) -> bool:
        """Scores need the whole context after the prefill (KVzip's reconstruction): no decode-time eviction."""
        return self.cls.needs_reconstruction

    @property
    def selection_params(self) -> dict[str, Any]:
        """The parameters that change the family's selection (its own parameters excluded)."""
        own = _parameters(self.cls)
        return {k: v for k, v in self.params.items() if k in SELECTION_FIELDS and k not in own}

    def build(self, **extra: Any) -> Policy:
        """A fresh policy; ``extra`` adds what only the caller knows (a sample's answer positions)."""
        composed = self.selection_params
        try:
            policy = self.cls(**{k: v for k, v in self.params.items() if k not in composed}, **extra)
            if composed:
                policy.selection = replace(policy.selection, **composed)
                check_allocation(policy, policy.selection)
        except TypeError as err:
            raise ValueError(f"bad parameters for policy {self.text!r}: {err}") from err
        return policy


def _parameters(cls: type[Policy]) -> set[str]:
    """Keyword parameters a policy class accepts: its own and those it forwards (``**kwargs``) up the MRO."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = list(inspect.signature(init).parameters.values())[1:]
        names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break  # this class does not forward further
    return names


def parse(text: str) -> PolicySpec:
    """The :class:`PolicySpec` of ``text``; ValueError naming the bad name or parameter. Builds nothing."""
    if not isinstance(text, str):
        raise ValueError(f"a policy spec is a string such as 'snapkv(window=32)', got {type(text).__name__} "
                         f"{text!r}")
    family, params = parse_spec(text)
    if family not in _REGISTRY:
        raise ValueError(f"unknown policy {family!r}; available: {_listing()}")
    cls = _REGISTRY[family]
    allowed = _parameters(cls)
    composable = SELECTION_FIELDS if "selection" in allowed else frozenset()
    unknown = sorted(set(params) - allowed - composable)
    if unknown:
        raise ValueError(f"bad parameters for policy {text.strip()!r}: unknown {', '.join(map(repr, unknown))}; "
                         f"{family} takes {', '.join(sorted(allowed)) or 'no parameters'}"
                         + (f", and the selection's {', '.join(sorted(composable - allowed))}" if composable else ""))
    own = {k: v for k, v in params.items() if k in allowed}
    named = cls.named_params(**own)
    text = text.strip()
    if named != own:  # a file given by the path of a named one's bytes: keyed by the name (the text re-written)
        params = {k: named.get(k, v) for k, v in params.items()}
        own, text = named, format_spec(family, params)
    spec = PolicySpec(text, family, params, None, cls)
    if spec.selection_params:
        try:
            replace(Selection(), **spec.selection_params)  # a bad value fails here, before any work
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad selection for policy {text.strip()!r}: {err}") from err
    return replace(spec, digest=content_digest(text, cls.content_paths(**own)))


def content_digest(spec: str, paths: tuple[Path, ...]) -> str | None:
    """The sha256 of the one file that defines a policy; of several, the sha256 of their sha256s in order.

    None for a policy no file defines. ``spec`` names the policy in the error for a missing file.
    """
    digests = []
    for path in paths:
        if not path.is_file():
            raise ValueError(f"policy {spec!r}: file {path} does not exist")
        digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
    if len(digests) <= 1:  # one file: its own sha256, as rows recorded before several files counted
        return digests[0] if digests else None
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def get(name: str, **params) -> Policy:
    """Build the policy registered as ``name``; unknown names and parameters raise ValueError. Selection fields
    compose as in a spec: ``get("tova", allocation="layer")``."""
    return PolicySpec(name, name, params, None, family_class(name)).build()


def from_spec(text: str) -> Policy:
    """Build a policy from a spec string (parse, then build)."""
    return parse(text).build()
