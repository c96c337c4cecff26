"""Kernels of the library's own ops (Triton, imported only where Triton is)."""
