"""Which ops end a CUDA graph piece: the defaults plus `Config.splitting_ops`.

An op is named by its qualified name, "ns::op" (every overload) or "ns::op.overload".
`SplitOps.reason(target)` is the pure predicate the split pass uses: it returns a
sentence saying why the target is split, or None when it can be captured.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

import torch
import torch.nn.functional as F

from .compat import cudagraph_unsafe_tag
from .errors import ConfigError
from .passes.sdpa import ATTENTION_FUNCTIONS

# Every form of scaled-dot-product attention that Dynamo or AOT autograd emits: the
# Python functions (ATTENTION_FUNCTIONS) and these aten ops.
_SDPA_ATEN_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "scaled_dot_product_attention",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
)
# Every op in these namespaces is attention with host-side metadata.
_SPLIT_NAMESPACES = frozenset({"flash_attn"})


def op_names(target: Any) -> tuple[str, str] | None:
    """("ns::op", "ns::op.overload") for a torch op object, None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name
        return packet, f"{packet}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name, f"{target._qualified_op_name}.default"
    return None


def _has_unsafe_tag(target: Any) -> bool:
    tag = cudagraph_unsafe_tag()
    if tag is None:
        return False
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(tag in getattr(target, o).tags for o in target.overloads())
    return isinstance(target, torch._ops.OpOverload) and tag in target.tags


def normalize_op(op: Any, field: str = "splitting_ops") -> str:
    """Turn an op object or an "ns::op[.overload]" string into a checked qualified name;
    errors name the Config `field` the op was given in."""
    names = op_names(op)
    if names is not None:
        return names[1] if isinstance(op, torch._ops.OpOverload) else names[0]
    if not isinstance(op, str):
        raise ConfigError(
            f"{field}: expected an op such as torch.ops.aten.mm or a string 'ns::op', "
            f"got {op!r} of type {type(op).__name__}"
        )
    _lookup(op, field)
    return op


def _lookup(name: str, field: str) -> Any:
    """Resolve "ns::op[.overload]" to the op object, with an error a user can act on."""
    if "::" not in name:
        raise ConfigError(
            f"{field}: expected a qualified name 'ns::op' or 'ns::op.overload', got {name!r}; "
            f"write for example 'aten::mm' or 'mylib::attention.default'"
        )
    namespace, rest = name.split("::", 1)
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return getattr(packet, overload) if overload else packet
    except (AttributeError, RuntimeError) as e:
        raise ConfigError(
            f"{field}: expected a registered op, got {name!r}, which is not registered; check "
            f"the spelling, and import the library that defines it before building the Config"
        ) from e


@dataclasses.dataclass(frozen=True)
class SplitOps:
    """The set of ops that end a capturable piece. Built from `Config.splitting_ops`."""

    extra: frozenset[str] = frozenset()

    def reason(self, target: Any) -> str | None:
        if target in ATTENTION_FUNCTIONS:
            return f"{target.__name__} is split by default (attention)"
        names = op_names(target)
        if names is None:
            return None
        packet, overload = names
        if packet in self.extra or overload in self.extra:
            return f"{overload} is listed in Config.splitting_ops"
        if packet in _SDPA_ATEN_OPS:
            return f"{packet} is split by default (attention)"
        if packet.split("::")[0] in _SPLIT_NAMESPACES:
            return f"{packet} is split by default (flash-attn)"
        if _has_unsafe_tag(target):
            return f"{overload} is tagged torch.Tag.cudagraph_unsafe"
        return None


# --------------------------------------------------------------------------------------
# Which split ops may be captured inside a full graph: `Config.capturable_split_ops`.
#
# A split op runs eagerly between piecewise graphs because it may depend on host-side
# state that changes every call. Declaring it capturable is the promise that it reads
# nothing but its arguments: no host state, no plan built outside the graph. Then a full
# graph of the whole Dynamo graph replays it correctly whenever its arguments are the
# graph's own: every tensor it reads is either made inside the graph or lies at the
# address it was captured with, and every host value (a SymInt argument, a size) equals
# the captured one. `passes.full_graph_plan` finds those arguments among the graph's
# inputs and `cgcompile.run.full_graph` checks them per call; the declaration alone never
# replays a stale value.
#
# Entries: an op object (`torch.ops.mylib.attention`), a qualified name "ns::op" or
# "ns::op.overload", or "attention" for every form of scaled-dot-product attention
# (the functions Dynamo records, their aten ops and cgcompile's grouped-query rewrite).


ATTENTION = "attention"


def normalize_capturable(entry: Any) -> str:
    """"attention" for any spelling of SDPA, else the checked qualified op name."""
    if entry == ATTENTION or entry is F.scaled_dot_product_attention:
        return ATTENTION
    return normalize_op(entry, "capturable_split_ops")


@dataclasses.dataclass(frozen=True)
class CapturableOps:
    """The split ops a full graph may hold. Empty (the default): no full graphs."""

    names: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.names)

    def covers(self, target: Any) -> bool:
        """Whether a split node calling `target` may be captured into a full graph."""
        if ATTENTION in self.names and target in ATTENTION_FUNCTIONS:
            return True
        names = op_names(target)
        if names is None:
            return False
        packet, overload = names
        if ATTENTION in self.names and packet in _SDPA_ATEN_OPS:
            return True
        return packet in self.names or overload in self.names


# --------------------------------------------------------------------------------------
# Which SDPA backend the attention that cgcompile runs eagerly may use.
#
# SDPA's cuDNN backend builds an execution plan for every new shape and looks the plan up
# on every call. Measured on an H100 (torch 2.11, bf16, 1.1B Llama, eager generate()):
# 13.4 s of a first 256-token call went to SDPA, ~45-50 ms for each new key length, while
# a later call of the same lengths took 3.7 s in all. Attention split out of the graphs
# sees a new key length at every decode step, so by default cgcompile runs its eager pieces
# with the cuDNN backend switched off (`Config.cudnn_attention=False`); SDPA then picks
# among the others, which take any length with no setup. The caller's setting is
# restored when the call returns.


T = TypeVar("T")


def call_without_cudnn_attention(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) with SDPA's cuDNN backend off; the global flag is restored after."""
    if not torch._C._get_cudnn_sdp_enabled():  # already off (by the user, or an outer call)
        return fn(*args, **kwargs)
    torch._C._set_sdp_use_cudnn(False)
    try:
        return fn(*args, **kwargs)
    finally:
        torch._C._set_sdp_use_cudnn(True)
