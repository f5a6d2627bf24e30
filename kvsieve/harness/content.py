"""Results keyed by content: rows of a policy read from a file carry that file's digest.

A row of ``program:best.py`` or ``learned(checkpoint=...)`` is only meaningful for the bytes it was
computed with. Each such row records ``policy_digest`` (the sha256 of the program file or checkpoint,
:attr:`kvsieve.policies.registry.PolicySpec.digest`) in its config; before a grid runs,
:func:`check_store` refuses a store whose rows of the same spec
were computed from other bytes (or from unknown bytes: rows written before digests were recorded),
so an edited file is never silently scored by its old rows. Nor are rows computed in another dtype
paired with new ones: :func:`check_dtype` refuses a store whose rows of the model were computed in
another dtype (a resumed run on a machine where ``dtype="auto"`` picks otherwise).
"""

from __future__ import annotations

from kvsieve.harness.store import ResultsStore

__all__ = ["check_store", "check_dtype"]


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


def check_dtype(store: ResultsStore, model: str, dtype: str) -> None:
    """Refuse when ``store`` holds rows of ``model`` computed in a dtype other than ``dtype`` (a name such as
    ``"float32"``): a policy's row and the full cache's row it is paired with must share their arithmetic."""
    other = sorted(store.dtypes(model=model) - {dtype})
    if other:
        raise ValueError(
            f"the store {store.path} holds rows of {model} computed in {', '.join(other)}, and this run computes "
            f"in {dtype}: rows of both would be paired in one table. Pass --dtype {other[0]} to continue the store "
            "as it was computed, or write to another --store")
