"""Moved: the policy interface now lives in :mod:`kvsieve.policy` (edit it there).

Kept for the importers that still name this module while the house is redrawn (issue 19).
"""

from kvsieve.policy import Policy, check_allocation

__all__ = ["Policy", "check_allocation"]
