"""kvsieve: decide which KV-cache entries to keep, and how far the cache can shrink safely.

The top-level names load on first use (PEP 562), so ``kvsieve --help`` and light modules (the grid
definition, the store, the contract) do not pay for importing torch and transformers.
"""

from importlib import import_module

__all__ = ["attach", "policies", "Budget", "Selection", "Signals"]
__version__ = "0.1.0"

_LAZY = {"attach": ("kvsieve.engine", "attach"), "policies": ("kvsieve.policies", None),
         "Budget": ("kvsieve.selection", "Budget"), "Selection": ("kvsieve.selection", "Selection"),
         "Signals": ("kvsieve.signals", "Signals")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kvsieve' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = import_module(module) if attr is None else getattr(import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
