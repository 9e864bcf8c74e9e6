"""Benchmarks of cuckoo-guard on real Redis: ``python -m bench <suite>`` (bench/suites.py)."""
