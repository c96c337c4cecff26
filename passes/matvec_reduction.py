"""Linears of one row written as a multiply and a sum over the input features.

At one row (a batch-1 decode step) `linear(x, w, b)` is a matrix-vector product: it reads
all of `w` to make a few thousand outputs, so its speed is the share of the copy bandwidth
its kernel reaches. cuBLAS picks kernels for matrix products; on an H200 its one-row
kernels read a 1B decoder's weights at 41% of the copy bandwidth, where Inductor's
reduction kernel for the same product, `(x * w).sum(-1)`, reached 60%, and 88% at the 8B
shapes with coordinate-descent tuning (`benchmarks/gemv_bench.py`). At eight rows the
reduction reads `w` once per row and falls to 11%: the rewrite is for one row only.

`matvec_as_reduction(gm, example_inputs)` returns a copy of `gm` in which every
`linear` whose input has exactly one row at the shapes of `example_inputs` (static
shapes only: a graph Dynamo compiled for one size, or a compile at one size, where every
shape is an int; a symbolic row count is left alone) and a half-precision dtype calls
`linear_as_reduction` instead, which multiplies and sums in float32 (as cuBLAS
accumulates) and rounds once. Other linears are left alone. The graph is copied, never
changed in place: the same piece keeps its general compile for other sizes.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.fx import GraphModule

from .graph_values import example_value

HALF_DTYPES = (torch.bfloat16, torch.float16)  # where the reduction was measured faster
_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


def linear_as_reduction(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as one reduction over the input features, in float32."""
    out = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def matvec_as_reduction(gm: GraphModule, example_inputs: Sequence) -> tuple[GraphModule, int]:
    """(a copy of `gm` with its one-row half-precision linears as reductions, how many)."""
    rewritten = GraphModule(gm, _copy_graph(gm))
    shapes = _tensor_metas(rewritten, example_inputs)
    count = 0
    for node in list(rewritten.graph.nodes):
        if node.op != "call_function" or node.target not in _LINEARS:
            continue
        x, weight = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        if not _is_one_row(shapes.get(x), shapes.get(weight)):
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        node.target = linear_as_reduction
        node.args, node.kwargs = (x, weight, bias), {}
        count += 1
    if count:
        rewritten.recompile()
    return rewritten, count


def _is_one_row(x_meta, w_meta) -> bool:
    if x_meta is None or w_meta is None:
        return False
    (x_shape, x_dtype), (w_shape, w_dtype) = x_meta, w_meta
    return (x_dtype in HALF_DTYPES and w_dtype == x_dtype and len(w_shape) == 2
            and len(x_shape) >= 1 and math.prod(x_shape[:-1]) == 1)


def _copy_graph(gm: GraphModule) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return graph


def _tensor_metas(gm: GraphModule, example_inputs: Sequence) -> dict:
    """Every tensor value's (shape, dtype) at `example_inputs`, by node of `gm`: from the
    nodes' own fake values where the inputs are fake (a compile of Dynamo's graph), else
    from a run of a copy on fake tensors made from the real inputs (nothing is computed or
    written). Values with a symbolic shape are left out (their row count is unknown), and
    tensor subclasses such as DTensor shards (whose placements the reduction would have to
    keep): their linears stay as they are."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if any(isinstance(a, FakeTensor) for a in example_inputs):
        values = {node: example_value(node) for node in gm.graph.nodes}
    else:
        values = _propagated(gm, example_inputs)
    return {node: (tuple(v.shape), v.dtype) for node, v in values.items()
            if isinstance(v, torch.Tensor) and not is_traceable_wrapper_subclass(v)
            and all(type(s) is int for s in v.shape)}


def _propagated(gm: GraphModule, example_inputs: Sequence) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]
    probe = GraphModule(gm, _copy_graph(gm))
    FakeTensorProp(probe, mode).propagate_dont_convert_inputs(*fake)
    return {node: probed.meta.get("val") for node, probed in zip(gm.graph.nodes, probe.graph.nodes)}
