"""Benchmarks; run them as scripts (see each module's docstring)."""
