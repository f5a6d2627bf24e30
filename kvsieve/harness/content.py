"""Results keyed by content: rows of a policy read from a file carry that file's digest.

A row of ``program:best.py`` or ``learned(checkpoint=...)`` is only meaningful for the bytes it was
computed with. Each such row records ``policy_digest`` (the sha256 of the program file or checkpoint)
in its config; before a grid runs, :func:`check_store` refuses a store whose rows of the same spec
were computed from other bytes (or from unknown bytes: rows written before digests were recorded),
so an edited file is never silently scored by its old rows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvsieve.harness.store import ResultsStore
from kvsieve.learn.policy import resolve_checkpoint
from kvsieve.spec import parse_spec

__all__ = ["content_digest", "check_store"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def content_digest(spec: str) -> str | None:
    """sha256 of the file a spec reads (a program or a learned checkpoint); ``None`` for other policies."""
    name, params = parse_spec(spec)
    if name == "program":
        path = Path(params["path"])
        if not path.is_file():
            raise ValueError(f"policy {spec!r}: program file {path} does not exist")
        return _sha256(path)
    if name == "learned" and params.get("checkpoint") is not None:
        return _sha256(resolve_checkpoint(params["checkpoint"]))
    return None


def check_store(store: ResultsStore, model: str, labels: dict[str, str | None]) -> None:
    """Refuse when ``store`` holds rows of a label whose digest differs from ``labels[label]``.

    ``labels`` maps a stored policy label (``SPEC`` or ``SPEC@decodeN``) to its current digest; labels
    with no digest (ordinary policies) are not checked.
    """
    for label, digest in labels.items():
        if digest is None:
            continue
        stale = {row.config.get("policy_digest") for row in store.rows(model=model, policy=label)} - {digest}
        if stale:
            old = ", ".join(sorted(d[:12] if d else "unrecorded" for d in stale))
            quoted = label.replace("'", "''")
            raise ValueError(
                f"the store {store.path} holds rows of {label!r} for {model} computed from other file contents "
                f"(sha256 {old}; the file now has {digest[:12]}): those rows would be reused for the new file. "
                "Write to another --store, or delete them first: "
                f"sqlite3 {store.path} \"DELETE FROM cells WHERE policy = '{quoted}'\"")
