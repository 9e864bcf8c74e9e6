"""Helpers the tests and the benchmarks share: private redis-servers and clusters, child
processes on free ports, deleting a run's keys, the service under load, the churn workload.

Not part of the installed package (pyproject's packages are guard* and app*): it is imported
from the repository root, as `pytest` and `python -m bench` run. It imports the library, never
tests/, bench/ or app/ (the service runs as a child process, not imported).
"""
