"""Pure FX passes of cgcompile: classify nodes, choose the capture dimension, split,
and prove padding safe.

No CUDA, no runtime state and no import of the library here: every pass takes a graph
and returns data. The
rewrites insert calls to plain tensor functions defined beside them
(`additive_attention_mask`, `grouped_query_attention`, `small_query_attention`,
`linear_as_reduction`), which
run with the graph. `rewrite_skinny_linears` and `rewrite_skinny_groups` insert the op their
caller hands them.
Shipped as `cgcompile.passes`.
"""

from .attention_mask import hoist_mask_conversion
from .full_graph_plan import FullGraphPlan, plan_full_graph
from .device_scalars import DeviceScalars, host_output_code, read_scalars_from_device
from .capture_dim import CaptureDim, find_capture_dim, input_name
from .graph_values import (address, example_value, free_symbols, show_address, tensors_in, values_sharing_memory,
                           wrapped_tensors)
from .grouped_query import fold_grouped_query_attention
from .host_constants import hoist_host_constants
from .padding_safety import PaddingHazard, find_padding_hazards, find_state_hazards
from .sibling_linears import FusedInput, fuse_sibling_linears
from .skinny_linear import SkinnyLinear, find_skinny_linears, rewrite_skinny_linears
from .skinny_groups import SkinnyGroup, find_skinny_groups, rewrite_skinny_groups
from .small_query import lower_small_query_attention
from .split import PieceSpec, SplitGraph, split_graph
from .matvec_reduction import linear_as_reduction, matvec_as_reduction
from .mutation import written_inputs
from .split_rule import SplitReason, classify_nodes, is_floating

__all__ = [
    "CaptureDim",
    "DeviceScalars",
    "FullGraphPlan",
    "FusedInput",
    "PaddingHazard",
    "PieceSpec",
    "SplitGraph",
    "SkinnyGroup",
    "SkinnyLinear",
    "SplitReason",
    "address",
    "classify_nodes",
    "example_value",
    "find_capture_dim",
    "find_padding_hazards",
    "find_skinny_linears",
    "find_state_hazards",
    "fold_grouped_query_attention",
    "free_symbols",
    "fuse_sibling_linears",
    "hoist_host_constants",
    "hoist_mask_conversion",
    "host_output_code",
    "input_name",
    "is_floating",
    "linear_as_reduction",
    "lower_small_query_attention",
    "matvec_as_reduction",
    "plan_full_graph",
    "read_scalars_from_device",
    "rewrite_skinny_linears",
    "show_address",
    "split_graph",
    "tensors_in",
    "values_sharing_memory",
    "wrapped_tensors",
    "written_inputs",
]
