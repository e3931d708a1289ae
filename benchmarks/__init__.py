"""The benchmarks of record: the paper's tables and figures with cuDNN measured beside them.

Run as modules from the repository root, e.g. `python -m benchmarks.paper table3 --runs 3
--cgemm-tf32`; each module's docstring lists its commands. benchmarks.harness holds what they
share; benchmarks.experiments holds one-off experiments, not benchmarks of record.
"""
