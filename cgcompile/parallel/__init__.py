"""Piecewise graphs across GPUs: `distributed` (collectives inside graphs, process-group
checks) and `pipeline` (a pipeline stage per process, with its ring schedule)."""
