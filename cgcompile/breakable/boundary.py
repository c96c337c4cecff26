"""Find the module whose forward the breakable runner captures (the layer stack).

Capturing only the stack lets batch-shaped tails (logits processor, pooler, sampler)
run eagerly on the live batch. `boundary` is "auto", a module, an attribute path such
as "model.language_model", or None for the whole model. `layers_of` finds the stack's
list of layers, for integrations that capture each layer rather than the stack (the
transformers one: the stack's own forward computes positions and masks on the host).
"""

from __future__ import annotations

import logging

from torch import nn

from ..errors import ConfigError

log = logging.getLogger(__name__)

# Where common layouts keep their decoder stack, most specific first.
_STACK_PATHS = (
    "model.language_model",
    "language_model.model",
    "model.model",
    "model",
    "language_model",
    "transformer",
    "gpt_neox",
    "model.decoder",
    "decoder",
)
_LAYER_LISTS = ("layers", "h", "layer", "blocks")


def _has_layer_list(module: nn.Module) -> bool:
    return layers_of(module) is not None


def layers_of(module: nn.Module) -> nn.ModuleList | None:
    """The module's list of layers (`layers`, `h`, `layer` or `blocks`), or None."""
    for name in _LAYER_LISTS:
        layers = getattr(module, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    return None


def _get(model: nn.Module, path: str) -> nn.Module | None:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return module if isinstance(module, nn.Module) else None


def resolve_boundary(model: nn.Module, boundary) -> nn.Module:
    if boundary is None:
        return model
    if isinstance(boundary, nn.Module):
        if not any(m is boundary for m in model.modules()):
            raise ConfigError(
                f"boundary: expected a submodule of {type(model).__name__}, got a "
                f"{type(boundary).__name__} that is not part of it"
            )
        return boundary
    if not isinstance(boundary, str):
        raise ConfigError(f"boundary: expected 'auto', a module, an attribute path or None, got {boundary!r}")
    if boundary == "auto":
        return _auto(model)
    module = _get(model, boundary)
    if module is None:
        children = [name for name, _ in model.named_children()]
        raise ConfigError(
            f"boundary: expected the attribute path of a submodule of {type(model).__name__}, got "
            f"{boundary!r}, which names none; its children are {children}"
        )
    return module


def _auto(model: nn.Module) -> nn.Module:
    for path in _STACK_PATHS:
        module = _get(model, path)
        if module is not None and _has_layer_list(module):
            return module
    if _has_layer_list(model):
        return model
    log.warning(
        "cgcompile: boundary='auto' found no layer stack in %s (looked for %s with a ModuleList "
        "named %s); capturing the whole model. Pass boundary=<module or attribute path> to "
        "capture only the stack, or boundary=None to silence this.",
        type(model).__name__, ", ".join(_STACK_PATHS), "/".join(_LAYER_LISTS),
    )
    return model
