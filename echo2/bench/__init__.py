"""Benchmarks that print ratios measured side by side in one run (``echo2 bench ...``, ``make bench``)."""
