"""Breakable CUDA graphs: the eager model captured in segments, broken at the split ops.

No compile: `runner.BreakableRunner` records one call of a module op by op
(`record`), captures the capturable stretches as CUDA graphs (`segments`) and replays
them with the split ops run eagerly between. `signature` decides when a recording may be
replayed; `boundary` and `path` decide which modules get runners; `integrations` and
`transformers` hold what a framework's models need.
"""

from .runner import BreakableRunner, eager_break

__all__ = ["BreakableRunner", "eager_break"]
