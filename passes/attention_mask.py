"""Convert a boolean SDPA mask to its additive form once per graph, not once per layer.

Given a boolean `attn_mask`, scaled_dot_product_attention first builds a float mask in
the query's dtype (0 where True, -inf where False), and the memory-efficient backend
then pads it to a 16-element row stride unless it already has one. A transformer hands
the same boolean mask to the SDPA of every layer, so a decode step repeats that work
once per layer: three or four small ops, ~20 us of host time per call on an H100 with
torch 2.11. When the mask depends on the cache length, all of it runs eagerly.

`hoist_mask_conversion` rewrites the graph so that each boolean mask feeding SDPA is
converted once, right after it is computed, into a float mask whose rows start at
16-element boundaries; every SDPA of that dtype reads the converted mask. The values
SDPA computes with are the ones it would have built itself.
"""

from __future__ import annotations

import contextlib

import torch
from torch.fx import GraphModule, Node

from .graph_values import example_value
from .sdpa import ATTENTION_FUNCTIONS

_ROW_ALIGNMENT = 16  # elements; the memory-efficient kernel's bias alignment


def additive_attention_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's own conversion of a boolean mask (0 where True, -inf where False), with
    the last dimension's rows starting at multiples of 16 elements. Dimensions the mask
    broadcasts (stride 0, e.g. after `expand` over heads) stay broadcast, not materialised."""
    broadcast = [d for d in range(mask.dim() - 1) if _is_zero(mask.stride(d))]
    base = mask
    for d in broadcast:
        base = base.narrow(d, 0, 1)
    length = mask.shape[-1]
    padded = (length + _ROW_ALIGNMENT - 1) // _ROW_ALIGNMENT * _ROW_ALIGNMENT
    out = torch.zeros((*base.shape[:-1], padded), dtype=dtype, device=mask.device).narrow(-1, 0, length)
    out.masked_fill_(base.logical_not(), float("-inf"))
    return out.expand(mask.shape) if broadcast else out


def _is_zero(stride) -> bool:
    return type(stride) is int and stride == 0


def _mask_argument(node: Node) -> tuple[str | int, Node] | None:
    """Where an SDPA call takes its attn_mask (kwarg name or position) and the node, if any."""
    if "attn_mask" in node.kwargs:
        mask = node.kwargs["attn_mask"]
        return ("attn_mask", mask) if isinstance(mask, Node) else None
    if len(node.args) > 3 and isinstance(node.args[3], Node):
        return 3, node.args[3]
    return None


def hoist_mask_conversion(gm: GraphModule) -> int:
    """Rewrite SDPA calls with a boolean mask to read a float mask converted once; returns
    how many converted masks were inserted. The graph is changed in place."""
    uses: dict[tuple[Node, torch.dtype], list[tuple[Node, str | int]]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ATTENTION_FUNCTIONS:
            continue
        found = _mask_argument(node)
        out, mask_value = example_value(node), example_value(found[1]) if found else None
        if found is None or not isinstance(mask_value, torch.Tensor) or mask_value.dtype != torch.bool:
            continue
        if not isinstance(out, torch.Tensor):
            continue
        uses.setdefault((found[1], out.dtype), []).append((node, found[0]))
    for (mask, dtype), calls in uses.items():
        with gm.graph.inserting_after(mask):
            converted = gm.graph.call_function(additive_attention_mask, (mask, dtype))
        fake_mask = example_value(mask)
        with getattr(fake_mask, "fake_mode", None) or contextlib.nullcontext():
            converted.meta["example_value"] = additive_attention_mask(fake_mask, dtype)
        for call, where in calls:
            if isinstance(where, str):
                call.kwargs = {**call.kwargs, where: converted}
            else:
                call.args = (*call.args[:where], converted, *call.args[where + 1 :])
    if uses:
        gm.graph.lint()
        gm.recompile()
    return len(uses)
