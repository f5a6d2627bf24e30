"""The policy program language: what an evolved program is (``program_source``: source text and its SELECTION),
what it may read (``program_features``: the compact interface ``f``), the static check every program passes
first (``static_check``) and the interpreter that evaluates it as data, never as Python (``interpreter``).
The policy that runs programs is :mod:`kvsieve.policies.program`; evolution, which writes them, is
:mod:`kvsieve.evolve`."""
