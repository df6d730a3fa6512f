"""Benchmarks of gmpo_jax against the dense reference, the PyTorch peers and the measured floors.

Entry points: ``python -m benchmarks.run`` (one configuration or a suite, one process per job),
``python -m benchmarks.report`` (RESULTS.md tables and the plot), ``bash benchmarks/gpu_suite.sh`` (the
whole GPU run in one device call). Shapes live in ``benchmarks/shapes.py``.
"""
