"""Research scripts of the learned policies (moved out of ``kvsieve.learn``): the held-out KL comparison of
checkpoints (``compare.py``), the gradient-noise ablation (``variance.py``) and the held-out curves of replicated
runs (``curves.py``). Each runs as ``python benchmarks/learn/NAME.py``; tests import them as ``learn.NAME`` with
``benchmarks/`` on the path (tests/benchmarks/conftest.py)."""
