"""Test-only loader for the hostile corpus: runs a candidate as plain Python, builtins and all.

``run_in_sandbox(..., layers={"raw_loader": this file})`` ships it into the worker in place of the
interpreter, so the tests can show what the process layer (seccomp, audit hook, limits, namespaces)
stops on its own. kvsieve itself never runs a candidate this way.
"""

import builtins

import torch

from kvsieve.language import program_features as features


def load(source: str):
    namespace = {"__builtins__": builtins, "torch": torch, **features.HELPERS}
    exec(compile(source, "candidate", "exec"), namespace)  # noqa: S102 - the point of this file
    return namespace["score"]
