"""Contracts: certifications per request bucket, written to and read from a JSON file.

An unconditional contract has one bucket, ``all``. A conditional contract certifies each task, task
family or context-length bucket on its own requests. Its guarantee is simultaneous over the buckets: each
bucket is certified at delta / B (Bonferroni over B buckets), so with probability >= 1 - delta every
bucket's operating point has risk <= alpha on its own population.

Length buckets are defined on one quantity at both ends: the request's *context tokens* (the prompt's
compressed part, ``build_prompt(...).context_ids``), which every results row records in its config and which
the runtime counts on the request. A contract bucketed on the generator's nominal length (written before
that, or without the token counts) says so in ``length_quantity`` and the runtime warns when it routes one.

A contract certifies bytes, not names: ``points`` records, for every chosen point's policy spec, its parsed
family and parameters and the sha256 of the files that define it (a program, a checkpoint, the surrogate a
program reads; :class:`kvsieve.policies.registry.PolicySpec`). The runtime refuses a point whose file has
changed or gone since certification (:meth:`ContractFile.check_points`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvsieve.files import written_whole
from kvsieve.harness.store import ResultsStore
from kvsieve.policies import PolicySpec, parse
from kvsieve.policies.label import FULL_CACHE
from kvsieve.risk.certify import Certification, Contract, InsufficientCalibrationError, certify
from kvsieve.risk.losses import BUCKETINGS, LossTable, Request, length_bucket

__all__ = ["CONTRACT_VERSION", "LENGTH_QUANTITIES", "ContractFile", "certify_buckets", "request_context_tokens"]

CONTRACT_VERSION = 1
LENGTH_QUANTITIES = ("context_tokens", "nominal")  # what a length bucket's edges count


@dataclass
class ContractFile:
    """What ``kvsieve certify`` writes: the contract, how requests are bucketed, one certification per bucket."""

    contract: Contract
    model: str
    by: str = "none"  # none | task | task_family | length
    length_edges: list[int] = field(default_factory=list)
    buckets: dict[str, Certification] = field(default_factory=dict)
    source: dict = field(default_factory=dict)  # store path, policies, ratios: how to reproduce
    length_quantity: str = "context_tokens"  # see the module docstring; "nominal" in contracts that predate it
    # spec text of each chosen point -> {"family", "params", "digest"} as certified (see the module docstring);
    # empty in contracts that predate it, and filled from the files as they are now for one made in code
    points: dict[str, dict] = field(default_factory=dict)
    recorded: bool = True  # False: read from a file without ``points`` (nothing ties it to the files' bytes)

    def __post_init__(self) -> None:
        if self.recorded and not self.points:
            self.points = record_points(self.chosen_specs())

    def chosen_specs(self) -> list[str]:
        """The policy spec of every bucket's chosen point (a decode-time label without its ``@decodeN``)."""
        specs = {c.chosen.spec for c in self.buckets.values() if c.chosen is not None}
        return sorted(specs)

    def check_points(self, where: str = "the contract") -> dict[str, PolicySpec]:
        """Every chosen point's spec parsed now, refusing a file that is missing or not the certified bytes."""
        out: dict[str, PolicySpec] = {}
        for text in self.chosen_specs():
            try:
                spec = parse(text)
            except ValueError as err:
                raise ValueError(f"{where} certifies policy {text!r}, which cannot be loaded here: {err} (relative "
                                 f"paths resolve against the working directory, {Path.cwd()})") from None
            record = self.points.get(text)
            if spec.digest is not None:
                if record is None or record.get("digest") is None:
                    raise ValueError(f"{where} certifies policy {text!r}, defined by a file, but records no digest "
                                     "of that file (written before contracts recorded them): recertify it with "
                                     "kvsieve certify")
                if record["digest"] != spec.digest:
                    raise ValueError(f"{where} certifies policy {text!r} with file sha256 {record['digest'][:12]}, "
                                     f"but the file now has sha256 {spec.digest[:12]}: it changed after "
                                     "certification; recertify it (kvsieve certify) or restore the certified file")
            out[text] = spec
        return out

    def write(self, path: str | Path) -> Path:
        data = {"kvsieve_contract": CONTRACT_VERSION, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "contract": asdict(self.contract), "model": self.model, "by": self.by,
                "length_edges": self.length_edges, "length_quantity": self.length_quantity, "source": self.source,
                "points": self.points,
                "buckets": {name: cert.to_dict() for name, cert in self.buckets.items()}}
        with written_whole(path) as tmp:  # never leave a half-written contract
            tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        return Path(path)

    @classmethod
    def read(cls, path: str | Path) -> ContractFile:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"contract file {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"contract file {path} is not JSON: {err}") from err
        version = data.get("kvsieve_contract") if isinstance(data, dict) else None
        if version != CONTRACT_VERSION:
            raise ValueError(f"{path} is not a kvsieve contract of version {CONTRACT_VERSION} (found {version!r})")
        missing = [key for key in ("contract", "model", "by", "length_edges", "buckets") if key not in data]
        if missing:
            raise ValueError(f"contract file {path} lacks {', '.join(missing)}")
        try:
            out = cls(Contract(**data["contract"]), data["model"], data["by"], list(data["length_edges"]),
                      {name: Certification.from_dict(c) for name, c in data["buckets"].items()}, data.get("source", {}),
                      data.get("length_quantity", "nominal"),  # files without it bucketed on the nominal length
                      dict(data.get("points") or {}), "points" in data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"contract file {path} is malformed: {err}") from err
        try:
            out.validate()
        except ValueError as err:
            raise ValueError(f"contract file {path}: {err}") from err
        return out

    def validate(self) -> None:
        """Refuse what no certification can produce: an unknown bucketing, bad edges, no buckets (each point, chosen
        or candidate, was checked when it was read: :class:`~kvsieve.policies.label.Point`)."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty name, got {self.model!r}")
        if self.by not in BUCKETINGS:
            raise ValueError(f"by={self.by!r} is not one of {', '.join(BUCKETINGS)}")
        if self.length_quantity not in LENGTH_QUANTITIES:
            raise ValueError(f"length_quantity={self.length_quantity!r} is not one of {', '.join(LENGTH_QUANTITIES)}")
        edges = self.length_edges
        if any(isinstance(e, bool) or not isinstance(e, int) or e <= 0 for e in edges) or edges != sorted(set(edges)):
            raise ValueError(f"length_edges must be increasing positive integers, got {edges!r}")
        if self.by == "length" and not edges:
            raise ValueError("a contract bucketed by length needs length_edges")
        if not self.buckets:
            raise ValueError("the contract has no buckets")
        if not isinstance(self.points, dict) or any(not isinstance(r, dict) for r in self.points.values()):
            raise ValueError(f"points must map a policy spec to its family, params and digest, got {self.points!r}")


def record_points(specs: list[str]) -> dict[str, dict]:
    """Each spec's parsed family, parameters and file digest, as certified."""
    out = {}
    for text in specs:
        spec = parse(text)
        out[text] = {"family": spec.family, "params": spec.params, "digest": spec.digest}
    return out


def request_context_tokens(store: ResultsStore, model: str, requests: list[Request]) -> dict[Request, int]:
    """Context tokens of each request, from its full-KV row's config (what length buckets route on)."""
    wanted = set(requests)
    out: dict[Request, int] = {}
    for row in store.rows(policy=FULL_CACHE, model=model):
        request = (row.key.task, row.key.length, row.key.sample_id)
        if request in wanted and isinstance(row.config.get("context_tokens"), int):
            out[request] = int(row.config["context_tokens"])
    missing = sorted(wanted - set(out))
    if missing:
        raise ValueError(f"{len(missing)} full-KV row(s) of model {model!r} do not record context_tokens "
                         f"(first: {missing[0]}); length buckets need them: re-evaluate those samples")
    return out


def certify_buckets(table: LossTable, contract: Contract, model: str, by: str = "none",
                    length_edges: list[int] | None = None, seed: int = 0,
                    context_tokens: Mapping[Request, int] | None = None) -> ContractFile:
    """Certify each bucket of ``table`` at delta / (number of buckets).

    Unbucketed (``by="none"``) with too few requests raises InsufficientCalibrationError. A bucket of a
    conditional contract with too few requests falls back to full KV, with the reason recorded.
    ``context_tokens`` (see :func:`request_context_tokens`) makes length buckets count each request's context
    tokens, the quantity the runtime routes on; without it they count the nominal length and say so.
    """
    quantity = "nominal"
    if by == "length" and context_tokens is not None:
        if not length_edges:
            raise ValueError("bucketing by length needs length_edges, e.g. [2048, 4096]")
        missing = [r for r in table.requests if r not in context_tokens]
        if missing:
            raise ValueError(f"context_tokens lacks {len(missing)} request(s) of the table (first: {missing[0]})")
        names = [length_bucket(int(context_tokens[r]), length_edges) for r in table.requests]
        buckets = {name: np.flatnonzero(np.array(names) == name) for name in sorted(set(names))}
        quantity = "context_tokens"
    else:
        buckets = table.buckets(by, length_edges)
    if by != "length":
        quantity = "context_tokens"  # no length buckets: nothing to disagree about
    share = Contract(contract.alpha, contract.delta / len(buckets), contract.epsilon, contract.loss,
                     contract.correction, contract.split_fraction)
    out = ContractFile(contract, model, by or "none", sorted(length_edges or []), length_quantity=quantity)
    for name, rows in buckets.items():
        try:
            out.buckets[name] = certify(table.subset(rows), share, seed=seed)
        except InsufficientCalibrationError as err:
            if len(buckets) == 1:
                raise
            out.buckets[name] = Certification(share.alpha, share.delta, share.epsilon, share.loss, share.correction,
                                              len(rows), [], None, f"too few requests: {err}")
    out.points = record_points(out.chosen_specs())  # the bytes certified: a later edit of a file is refused
    return out
