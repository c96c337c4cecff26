"""Framework integrations: one module per framework, imported only when that framework is.

`integration_for(model)` looks at frameworks the process has already imported (it never
imports one) and returns the integration module for the model, or None. An integration
module provides `breakable_path(model, boundary, config, session, segments)`, which
builds the model's `BreakablePath`.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch


def integration_for(model: torch.nn.Module) -> ModuleType | None:
    modeling_utils = sys.modules.get("transformers.modeling_utils")  # loaded by any transformers model
    if modeling_utils is not None and isinstance(model, modeling_utils.PreTrainedModel):
        from . import transformers as integration

        return integration
    return None
