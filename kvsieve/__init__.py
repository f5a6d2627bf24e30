"""kvsieve: decide which KV-cache entries to keep, and how far the cache can shrink safely."""

from kvsieve import policies
from kvsieve.engine import attach
from kvsieve.selection import Budget, Selection
from kvsieve.signals import Signals

__all__ = ["attach", "policies", "Budget", "Selection", "Signals"]
__version__ = "0.1.0"
