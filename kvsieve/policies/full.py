"""Moved: ``FullCache`` now lives in :mod:`kvsieve.policy` beside the interface (edit it there)."""

from kvsieve.policy import FullCache

__all__ = ["FullCache"]
