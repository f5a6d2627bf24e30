"""Contracts: certifications per request bucket, written to and read from a JSON file.

An unconditional contract has one bucket, ``all``. A conditional contract certifies each task, task
family or context-length bucket on its own requests. Its guarantee is simultaneous over the buckets: each
bucket is certified at delta / B (Bonferroni over B buckets), so with probability >= 1 - delta every
bucket's operating point has risk <= alpha on its own population.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsieve.risk.certify import Certification, Contract, InsufficientCalibrationError, certify
from kvsieve.risk.losses import LossTable

__all__ = ["CONTRACT_VERSION", "ContractFile", "certify_buckets"]

CONTRACT_VERSION = 1


@dataclass
class ContractFile:
    """What ``kvsieve certify`` writes: the contract, how requests are bucketed, one certification per bucket."""

    contract: Contract
    model: str
    by: str = "none"  # none | task | task_family | length
    length_edges: list[int] = field(default_factory=list)
    buckets: dict[str, Certification] = field(default_factory=dict)
    source: dict = field(default_factory=dict)  # store path, policies, ratios: how to reproduce

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"kvsieve_contract": CONTRACT_VERSION, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "contract": asdict(self.contract), "model": self.model, "by": self.by,
                "length_edges": self.length_edges, "source": self.source,
                "buckets": {name: cert.to_dict() for name, cert in self.buckets.items()}}
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        tmp.replace(path)  # never leave a half-written contract
        return path

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
        return cls(Contract(**data["contract"]), data["model"], data["by"], list(data["length_edges"]),
                   {name: Certification.from_dict(c) for name, c in data["buckets"].items()}, data.get("source", {}))


def certify_buckets(table: LossTable, contract: Contract, model: str, by: str = "none",
                    length_edges: list[int] | None = None, seed: int = 0) -> ContractFile:
    """Certify each bucket of ``table`` at delta / (number of buckets).

    Unbucketed (``by="none"``) with too few requests raises InsufficientCalibrationError. A bucket of a
    conditional contract with too few requests falls back to full KV, with the reason recorded.
    """
    buckets = table.buckets(by, length_edges)
    share = Contract(contract.alpha, contract.delta / len(buckets), contract.epsilon, contract.loss,
                     contract.correction, contract.split_fraction)
    out = ContractFile(contract, model, by or "none", sorted(length_edges or []))
    for name, rows in buckets.items():
        try:
            out.buckets[name] = certify(table.subset(rows), share, seed=seed)
        except InsufficientCalibrationError as err:
            if len(buckets) == 1:
                raise
            out.buckets[name] = Certification(share.alpha, share.delta, share.epsilon, share.loss, share.correction,
                                              len(rows), [], None, f"too few requests: {err}")
    return out
