"""The policy program language: a loop-free, typed expression language whose cost is known before it runs.

``program_source`` (a program's text and its SELECTION), ``program_features`` (the compact interface ``f`` and
its helpers), ``operations`` (every operation with its typed signature and cost class: the language's one table),
``typed_graph`` (text -> typed graph, every shape inferred), ``cost`` (memory and time from the graph at given
dims, calibrated by ``benchmarks/language_cost.py``), ``interpreter`` (prices each call, then evaluates the graph
as data, never as Python), ``static_check`` (stage 0: the graph priced at 32k entries) and ``grammar`` (the
grammar exported for constrained decoding). The policy that runs programs is :mod:`kvsieve.policies.program`;
evolution, which writes them, is :mod:`kvsieve.evolve`; the page is docs/policy-language.md.
"""
