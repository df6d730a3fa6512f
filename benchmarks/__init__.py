"""Benchmarks of gmpo_jax against the dense reference, the PyTorch peers and the measured floors.

Entry points (benchmarks/README.md has one command per table): ``python -m benchmarks.run`` (one
configuration or a suite, one process per job), ``python -m benchmarks.report`` (the tables of README.md and
docs/performance.md, RESULTS.md and the plots, from ``results/*.jsonl``), ``bash benchmarks/gpu_suite.sh`` (a GPU suite in one
device call). Workloads (``peaked`` trained-LM-like, ``flat``) live in ``benchmarks/workloads.py``, shapes in
``benchmarks/shapes.py``; ``jax_impls.py`` is the only module that reaches into gmpo_jax beyond its public API.
"""
