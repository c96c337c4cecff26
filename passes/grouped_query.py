"""Attend a single query token with grouped KV heads without repeating the keys and values.

Grouped-query attention (fewer KV heads than query heads) reaches SDPA in most models
through `repeat_kv`: each KV head is copied to the G query heads that read it, as
x[:, :, None].expand(B, Hkv, G, L, D).reshape(B, Hkv * G, L, D). SDPA's own `enable_gqa`
cannot stand in when a mask is present (the memory-efficient kernel has no GQA mode, so
SDPA falls back to its math path). With a KV cache, L is the cache length: both copies
run eagerly every decode step, in every layer (~15 us of host time each on an H100).

When the query has one token, the G query heads of a KV head are G independent rows that
read the same keys, so `fold_grouped_query_attention` replaces the repeats and the SDPA
call with one `grouped_query_attention` call over the un-repeated cache (see there),
followed by `.unsqueeze(3).flatten(1, 2)` back to one row per query head. For a batch of
one the call returns the heads in order (`heads_outer`), so that is a view; for more it
returns them rows outer, and it is a copy, made by the next captured piece since its shape
is static. Each output row is the same attention as before; the kernel groups its work
differently, so results agree to rounding, not bit for bit.

Left alone: queries of more than one token (the mask would have to be repeated G
times), causal calls, dropout, calls with `enable_gqa`, and repeats with other users.
"""

from __future__ import annotations

import operator

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch.fx import GraphModule, Node

from .graph_values import example_value
from .sdpa import SDPA_FUNCTIONS, grouped_query_attention, sdpa_arguments

_FULL = slice(None, None, None)


def fold_grouped_query_attention(gm: GraphModule) -> int:
    """Rewrite single-token SDPA calls over repeated KV heads; returns how many were
    rewritten. The graph is changed in place; the repeats are removed."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in SDPA_FUNCTIONS and _fold(gm, node):
            folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _fold(gm: GraphModule, call: Node) -> bool:
    args = _foldable_arguments(call)
    if args is None:
        return False
    query, key, value, mask = args["query"], args["key"], args["value"], args.get("attn_mask")
    kv = [_repeated_source(key), _repeated_source(value)]
    if None in kv or kv[0][1] != kv[1][1] or key.users.keys() != {call} or value.users.keys() != {call}:
        return False
    (key_source, groups), (value_source, _) = kv
    q = example_value(query)
    kv_heads = example_value(key_source).shape[1]
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not _is_int(q.shape[2], 1):
        return False
    if not _is_int(q.shape[1], kv_heads * groups) or (mask is not None and not _mask_folds(mask, q.shape[1])):
        return False

    kwargs = {"attn_mask": mask, "scale": args.get("scale")}
    if _is_int(q.shape[0], 1):  # one sequence: the result in head order, unflattened by a view
        kwargs["heads_outer"] = True
    graph = gm.graph
    with graph.inserting_before(call):
        grouped = graph.call_function(grouped_query_attention, (query, key_source, value_source), kwargs)
        grouped.meta.update({k: v for k, v in call.meta.items() if k != "val"})
        grouped.meta["example_value"] = _fake_run(grouped_query_attention, (query, key_source, value_source), kwargs)
        # Back to one row per query head: a copy where the result is laid out rows outer,
        # so it belongs to the next (captured) piece, not to the eager one.
        unfolded = _method(graph, "unsqueeze", grouped, 3)
        unfolded = _method(graph, "flatten", unfolded, 1, 2)
    call.replace_all_uses_with(unfolded)
    graph.erase_node(call)
    for repeat in dict.fromkeys((key, value)):  # reshape, expand, then the inserted dim: each now unused
        while repeat is not None and not repeat.users:
            source = repeat.args[0]
            graph.erase_node(repeat)
            repeat = source if source not in (key_source, value_source) else None
    return True


def _foldable_arguments(call: Node) -> dict | None:
    """The SDPA call's arguments by name, or None when it is not a foldable call."""
    args = sdpa_arguments(call)
    if args is None or not all(isinstance(args.get(k), Node) for k in ("query", "key", "value")):
        return None
    if args.get("dropout_p", 0.0) != 0.0 or args.get("is_causal", False) or args.get("enable_gqa", False):
        return None
    if args.get("attn_mask") is not None and not isinstance(args["attn_mask"], Node):
        return None
    if isinstance(args.get("scale"), Node):
        return None
    return args


def _repeated_source(node: Node) -> tuple[Node, int] | None:
    """(x, G) when node is x [B, H, L, D] with each head repeated G times in a row."""
    if not _is_method_or_function(node, "reshape") or len(node.args) < 1:
        return None
    expanded = node.args[0]
    if not isinstance(expanded, Node) or not _is_method_or_function(expanded, "expand"):
        return None
    inserted = expanded.args[0]
    if not isinstance(inserted, Node) or expanded.users.keys() != {node} or inserted.users.keys() != {expanded}:
        return None
    source = _unsqueezed_at_2(inserted)
    if source is None:
        return None
    x, e, r = example_value(source), example_value(expanded), example_value(node)
    if not all(isinstance(t, torch.Tensor) for t in (x, e, r)) or x.dim() != 4 or e.dim() != 5 or r.dim() != 4:
        return None
    groups = e.shape[2]
    if not isinstance(groups, int) or not isinstance(x.shape[1], int):
        return None
    expected_expand = (x.shape[0], x.shape[1], groups, x.shape[2], x.shape[3])
    expected_reshape = (x.shape[0], x.shape[1] * groups, x.shape[2], x.shape[3])
    if not (_same_shape(e.shape, expected_expand) and _same_shape(r.shape, expected_reshape)):
        return None
    return source, groups


def _unsqueezed_at_2(node: Node) -> Node | None:
    """x when node is x[:, :, None, :, :] or x.unsqueeze(2) of a 4-d x."""
    if node.op == "call_function" and node.target is operator.getitem:
        x, index = node.args
        if index == (_FULL, _FULL, None, _FULL, _FULL) or index == (_FULL, _FULL, None):
            return x if isinstance(x, Node) else None
        return None
    if _is_method_or_function(node, "unsqueeze"):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return node.args[0] if dim == 2 and isinstance(node.args[0], Node) else None
    return None


def _mask_folds(mask: Node, query_heads: int) -> bool:
    """Whether grouped_query_attention can take the mask: one row (the query's token),
    broadcast over heads or one per query head."""
    m = example_value(mask)
    if not isinstance(m, torch.Tensor) or not 1 <= m.dim() <= 4:
        return False
    if m.dim() >= 2 and not _is_int(m.shape[-2], 1):
        return False
    return m.dim() < 3 or _is_int(m.shape[-3], 1) or _is_int(m.shape[-3], query_heads)


def _method(graph, name: str, *args) -> Node:
    node = graph.call_method(name, args)
    node.meta["example_value"] = _fake_run(getattr(torch.Tensor, name), args, {})
    return node


def _fake_run(fn, args, kwargs):
    """fn on the example values of its node arguments, in their fake mode (with the Python
    dispatcher, as Dynamo runs ops: composite kernels then accept symbolic sizes)."""
    values = [example_value(a) if isinstance(a, Node) else a for a in args]
    kw = {k: example_value(v) if isinstance(v, Node) else v for k, v in kwargs.items()}
    fake_mode = next((getattr(v, "fake_mode", None) for v in values if isinstance(v, torch.Tensor)), None)
    if fake_mode is None:
        return fn(*values, **kw)
    with fake_mode, enable_python_dispatcher():
        return fn(*values, **kw)


def _is_method_or_function(node: Node, name: str) -> bool:
    if node.op == "call_method":
        return node.target == name
    return node.op == "call_function" and node.target in (getattr(torch, name, None), getattr(torch.Tensor, name))


def _is_int(size, value: int) -> bool:
    return type(size) is int and size == value


def _same_shape(shape, expected) -> bool:
    """Equal sizes without asking the shape environment (which would add guards)."""
    return len(shape) == len(expected) and all(_same_size(a, b) for a, b in zip(shape, expected))


def _same_size(a, b) -> bool:
    a = a.node.expr if isinstance(a, torch.SymInt) else a
    b = b.node.expr if isinstance(b, torch.SymInt) else b
    return a == b
