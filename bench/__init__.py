"""Benchmarks of the guard library against a real Redis server (``python -m bench core``)."""
