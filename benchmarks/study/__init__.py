"""The matched-budget study of evolution against its controls (issue 50; moved out of ``kvsieve.evolve``): the runs
(``runs.py``) and their report (``report.py``), driven by ``python benchmarks/evolve_compare.py``; tests import them
as ``study.runs`` / ``study.report`` with ``benchmarks/`` on the path (tests/benchmarks/conftest.py)."""
