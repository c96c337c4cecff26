"""Reading what was built: dumps, `python -m cgcompile.inspect`'s tables, memory plans, and
capture ahead of the first call."""
