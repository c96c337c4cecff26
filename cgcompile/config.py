"""The one frozen configuration object, grouped by concern and validated when it is built.

`Config` holds one small frozen record per concern (`Split`, `Sizes`, `Compile`, `Graphs`,
`Rewrites`, `FullGraphOptions`, `Debug`, `Manager`). Each field is declared once, with its doc
and its check, by `option`; everything else is derived from those declarations: the flat
keywords `Config(capture_sizes=...)` and the torch.compile options dict accept (aliases of
the group fields of the same name), the checks run at construction, and docs/config.md
(`python tools/config_docs.py`). Flat names are for writing a Config only: it is read
through its groups (`config.sizes.capture_sizes`), by the engine and by users alike.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import numbers
import os
import tempfile
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .errors import ConfigError, closest, expect, expected
from .ops import CapturableOps, normalize_capturable
from .ops import SplitOps, normalize_op

DEFAULT_CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 257, 8))
MAX_CAPTURE_SIZE = 65536  # rows (batch or tokens) of one call; see `_capture_sizes`
# Config.full_graph's default: full graphs wherever a graph has CUDA graphs (`Config.full_graph_for`).
AUTO = "auto"
COMPILERS = ("eager", "inductor")
DUMP_DIR_ENV = "CGCOMPILE_DUMP_DIR"
USE_BREAKABLE_ENV = "CGCOMPILE_USE_BREAKABLE"

Check = Callable[[str, Any], None]
Normalise = Callable[[str, Any], Any]


def option(default: Any, check: Check, doc: str, *, normalise: Normalise | None = None) -> Any:
    """A group's field: its default, its check (raises ConfigError naming the culprit) and
    its doc (rendered into docs/config.md). Its name is also its flat name in `Config(...)`
    and the options dict, so every name is unique across the groups. `normalise` turns
    accepted spellings (a list, a dict, numpy ints) into the stored form before the check runs."""
    metadata = {"check": check, "doc": " ".join(doc.split()), "normalise": normalise or _same}
    return dataclasses.field(default=default, metadata=metadata)


def _same(name: str, value: Any) -> Any:
    return value


# -- one check per field: each raises ConfigError("field: expected X, got Y; do Z") -------
# (the groups that use them follow; `option` names one per field)


def _bool(name: str, value: Any) -> None:
    expect(isinstance(value, bool), name, "True or False", value,
           f"write {name}=True or {name}=False (strings and 0/1 are not accepted)", ConfigError)


def _optional_bool(name: str, value: Any) -> None:
    expect(value is None or isinstance(value, bool), name, "None, True or False", value,
           f"write {name}=None (automatic), True or False", ConfigError)


def _count(fix: str = "") -> Check:
    def check(name: str, value: Any) -> None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        expect(ok, name, "a non-negative int", value, fix, ConfigError)

    return check


def _optional_text(fix: str) -> Check:
    def check(name: str, value: Any) -> None:
        ok = value is None or (isinstance(value, (str, os.PathLike)) and os.fspath(value) != "")
        expect(ok, name, "None or a non-empty string", value, fix, ConfigError)

    return check


def _dump_dir(name: str, value: Any) -> None:
    _optional_text("write dump_dir='path/to/folder'")(name, value)
    if value is not None:
        check_dump_dir(name, value)


def _choice(*choices: str) -> Check:
    def check(name: str, value: Any) -> None:
        fix = closest(value, choices) if isinstance(value, str) else ""
        expect(isinstance(value, str) and value in choices, name, f"one of {choices}", value, fix, ConfigError)

    return check


def _ops(name: str, value: Any) -> None:
    expect(isinstance(value, tuple), name, "a tuple or list of ops", value,
           f"write {name}=['ns::op'] even for one op", ConfigError)


def _splitting_ops(name: str, value: Any) -> None:
    _ops(name, value)
    for op in value:  # every name is looked up now, not at the first compile
        normalize_op(_held_op(op), name)


def _capturable_ops(name: str, value: Any) -> None:
    _ops(name, value)
    for op in value:
        _capturable(name, op)


def _held_op(op: Any) -> Any:
    """The op object behind what `@torch.library.custom_op` returns (a CustomOpDef, the
    object the user holds), else `op` itself."""
    overload = getattr(op, "_opoverload", None)
    return overload if isinstance(overload, torch._ops.OpOverload) else op


def _capturable(name: str, entry: Any) -> str:
    # normalize_op's own message would only ask for "ns::op"; a bare word is most likely
    # a name for attention, which has its own keyword here.
    expect(not isinstance(entry, str) or "::" in entry or entry == "attention", name,
           '"attention" (every form of scaled-dot-product attention), an op object or "ns::op[.overload]"',
           entry, 'write capturable_split_ops=("attention",) for SDPA', ConfigError)
    return normalize_capturable(_held_op(entry))


def _capture_sizes(name: str, sizes: Any) -> None:
    # The bound is generous (prefill token counts of a long prompt fit), but a call of size n
    # runs padded to the smallest capture size >= n: a size of 10**9 makes a 7-row call
    # allocate inputs and activations of 10**9 rows.
    expect(isinstance(sizes, tuple) and len(sizes) > 0, name, "a non-empty tuple or list of positive ints",
           sizes, "e.g. (1, 2, 4, 8)", ConfigError)
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
    expect(not bad, name, "positive ints", bad, "e.g. (1, 2, 4, 8)", ConfigError)
    large = [s for s in sizes if s > MAX_CAPTURE_SIZE]
    expect(not large, name, f"sizes of at most {MAX_CAPTURE_SIZE}", large,
           "use the batch or token counts the model runs: a call is padded to the smallest capture size "
           "above it, and its graph holds activations of that many rows", ConfigError)
    dupes = sorted(s for s, n in collections.Counter(sizes).items() if n > 1)
    expect(not dupes, name, "each size once", f"{dupes} more than once", "remove the repeats", ConfigError, raw=True)


def _sorted_sizes(sizes: Any) -> Any:
    """Sizes as sorted Python ints when every one is an integer (numpy's included), else
    as given, for `_capture_sizes` to refuse."""
    if not isinstance(sizes, tuple) or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                                               for s in sizes):
        return sizes
    return tuple(sorted(int(s) for s in sizes))


def _compile_sizes(name: str, sizes: Any) -> None:
    expect(isinstance(sizes, tuple), name, "a tuple or list of capture sizes", sizes, "e.g. compile_sizes=(1, 8)",
           ConfigError)
    if sizes:
        _capture_sizes(name, sizes)


def _check_compile_sizes(sizes: tuple[int, ...], capture_sizes: tuple[int, ...]) -> None:
    missing = [s for s in sizes if s not in capture_sizes]
    expect(not missing, "compile_sizes", "sizes from capture_sizes", missing,
           f"add them to capture_sizes or remove them (capture_sizes: {capture_sizes})", ConfigError)


def _as_pairs(name: str, options: Mapping) -> tuple[tuple[str, Any], ...]:
    expect(all(isinstance(k, str) for k in options), name, "a dict with str keys", options,
           "write e.g. {'coordinate_descent_tuning': True}", ConfigError)
    return tuple(sorted(options.items()))


# Inductor options that would break a piece replayed from cgcompile's own CUDA graphs.
_REFUSED_INDUCTOR_OPTIONS = {
    "triton.cudagraphs": "cgcompile captures the pieces itself; Inductor's graphs inside ours cannot be captured",
    "triton.cudagraph_trees": "cgcompile captures the pieces itself",
}


def _inductor_options(name: str, pairs: Any) -> None:
    ok = isinstance(pairs, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in pairs)
    expect(ok, name, "a dict of Inductor config options", pairs, "write e.g. {'coordinate_descent_tuning': True}",
           ConfigError)
    if not pairs:
        return
    from .compat import inductor_option_types

    known = inductor_option_types()
    for key, value in pairs:
        expect(key in known, name, "Inductor config options (torch._inductor.config)", f"unknown {key!r}",
               _unknown_option_fix(key, value, known), ConfigError, raw=True)
        expect(key not in _REFUSED_INDUCTOR_OPTIONS, name, "options that keep pieces capturable", repr(key),
               f"remove it: {_REFUSED_INDUCTOR_OPTIONS.get(key)}", ConfigError, raw=True)
        allowed = _plain_types(known[key])
        if allowed is not None:
            expect(_is_instance(value, allowed), f"{name}[{key!r}]",
                   f"a value of Inductor's type {' | '.join(t.__name__ for t in allowed)}", value,
                   f"e.g. {{{key!r}: {_example(allowed)!r}}}", ConfigError)


def _unknown_option_fix(key: str, value: Any, known: Mapping[str, Any]) -> str:
    nested = sorted(k for k in known if k.startswith(f"{key}."))
    if not nested:
        return closest(key, known) or "see torch._inductor.config for the names"
    example = ({f"{key}.{k}": v for k, v in list(value.items())[:2]} if isinstance(value, Mapping)
               else {nested[0]: "..."})
    return f"{key!r} is a group of options: write each as a dotted key, e.g. {example}"


_PLAIN = (bool, int, float, str, type(None))


def _plain_types(value_type: Any) -> tuple[type, ...] | None:
    """The types an option declared as `value_type` takes, when all are plain (bool, int,
    float, str, None); None when the declaration holds anything else (not checked)."""
    members = typing.get_args(value_type) if isinstance(value_type, types.UnionType) or \
        typing.get_origin(value_type) is typing.Union else (value_type,)
    return tuple(members) if all(m in _PLAIN for m in members) else None


def _is_instance(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # a bool is an int to isinstance, not to Inductor
        return bool in allowed
    if float in allowed and isinstance(value, int):
        return True
    return isinstance(value, allowed)


_EXAMPLES = {bool: True, int: 1, float: 1.0, str: "..."}


def _example(allowed: tuple[type, ...]) -> Any:
    return next((_EXAMPLES[t] for t in allowed if t in _EXAMPLES), None)




# -- accepted spellings, stored in one form (hashable, frozen) -----------------------------


def _as_tuple(name: str, value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _as_sizes(name: str, value: Any) -> Any:
    """Sorted Python ints when every entry is an integer (numpy's included), else as given
    for the check to refuse: the order of sizes means nothing."""
    return _sorted_sizes(_as_tuple(name, value))


def _as_option_pairs(name: str, value: Any) -> Any:
    return _as_pairs(name, value) if isinstance(value, Mapping) else value


# -- the groups --------------------------------------------------------------------------


class _Group:
    """What every group does when it is built: normalise each field, then check it."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = field.metadata["normalise"](field.name, getattr(self, field.name))
            object.__setattr__(self, field.name, value)
            field.metadata["check"](field.name, value)


def _group(cls: type) -> type:
    """`cls` as a frozen keyword-only dataclass whose unknown or positional arguments raise
    ConfigError (with the nearest name), as Config's do. A name in the class's `_RENAMED`
    (old name -> field) is still accepted, with a DeprecationWarning."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    init = cls.__init__

    @functools.wraps(init)
    def checked_init(self, *args: Any, **kwargs: Any) -> None:
        kwargs = _renamed(cls, kwargs)
        _check_names(cls.__name__, args, kwargs, [f.name for f in dataclasses.fields(cls)])
        init(self, **kwargs)

    cls.__init__ = checked_init
    return cls


def _renamed(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the old names of `cls`'s fields replaced by the new ones, each with a warning."""
    renamed = getattr(cls, "_RENAMED", {})
    for old in [name for name in kwargs if name in renamed]:
        new = renamed[old]
        expect(new not in kwargs, cls.__name__, f"{new} once", f"both {old} and {new}",
               f"write only {new} ({old} is its old name)", ConfigError, raw=True)
        warnings.warn(f"{cls.__name__}({old}=...) is deprecated: write {cls.__name__}({new}=...), "
                      f"the name it has in Config(...) too", DeprecationWarning, stacklevel=3)
        kwargs = {(new if name == old else name): value for name, value in kwargs.items()}
    return kwargs


@_group
class Split(_Group):
    """Where the Dynamo graph is split into pieces, and how the split ops run between them."""

    splitting_ops: tuple[Any, ...] = option((), _splitting_ops, normalise=_as_tuple, doc="""
        Ops to split at besides the defaults (attention in every form, flash-attn ops, ops tagged
        `cudagraph_unsafe`): op objects (what `@torch.library.custom_op` returns too) or
        "ns::op[.overload]". Every name is looked up when the Config is built.""")
    cudnn_attention: bool = option(False, _bool, doc="""
        Let scaled_dot_product_attention in the eager pieces use its cuDNN backend. Off by default:
        cuDNN builds a plan for every new key length, and split attention sees a new length at
        every decode step. See `cgcompile.ops`.""")


@_group
class Sizes(_Group):
    """Which sizes of the capture dimension get CUDA graphs, and how calls of other sizes reach them."""

    capture_sizes: tuple[int, ...] = option(DEFAULT_CAPTURE_SIZES, _capture_sizes, normalise=_as_sizes, doc="""
        Sizes of the capture dimension that get a CUDA graph; a call of size n runs padded to the
        smallest capture size >= n. Any order, any int type (numpy's too): stored as sorted Python
        ints. At most 65536 each.""")
    capture_input: str | None = option(None, _optional_text(
        "name the input as in forward, e.g. capture_input='input_ids'"), doc="""
        Which graph input holds the capture dimension, named as in the model's forward (e.g.
        "input_ids"); None: the default rule of `cgcompile.passes.find_capture_dim`.""")
    capture_input_dim: int = option(0, _count("e.g. 1 for input_ids' dimension 1"), doc="""
        Which dimension of `capture_input` is the capture dimension. Needs `capture_input`.""")
    padding: bool | None = option(None, _optional_bool, doc="""
        None pads calls to the capture sizes when CUDA graphs are on; True pads them even without
        graphs (on CPU too: how the tests exercise padding); False never pads (every graph is
        captured at the exact sizes seen). A Dynamo graph whose capturable code mixes rows along
        the capture dimension is never padded, whatever this says (see
        `cgcompile.passes.padding_safety`). Breakable graphs, which have no graph to check, pad
        only with True: the user's word that rows never mix.""")
    exact_size_limit: int = option(32, _count("0 runs graphs that cannot be padded without CUDA graphs"), doc="""
        A graph that runs at exact sizes (padding off, or unsafe to pad) captures one set of CUDA
        graphs per distinct size: for each capture size, and for at most this many other sizes;
        calls of further new sizes run its pieces without graphs (logged once).""")

    def __post_init__(self) -> None:
        super().__post_init__()
        # The default rule finds its own dimension: a dimension without an input would be dropped.
        expect(self.capture_input is not None or self.capture_input_dim == 0, "capture_input_dim",
               "capture_input beside it (the input whose dimension it names)",
               f"capture_input_dim={self.capture_input_dim} without capture_input",
               "add capture_input='<the forward argument>' (e.g. capture_input='input_ids'), or leave "
               "capture_input_dim out", ConfigError, raw=True)


@_group
class Compile(_Group):
    """How the capturable pieces are compiled."""

    compiler: str = option("inductor", _choice(*COMPILERS), doc="""
        "eager" runs capturable pieces as FX code; "inductor" compiles each once.""")
    compile_sizes: tuple[int, ...] = option((), _compile_sizes, normalise=_as_sizes, doc="""
        Capture sizes whose pieces are also compiled with the capture dimension fixed (Inductor can
        then pick kernels for that exact shape, e.g. a matrix-vector product at size 1); the graphs
        of those sizes replay the specialised code, other sizes the general compile. Each adds one
        compile per distinct piece, at the first call of that size (counted in
        `stats.specialised_compilations`, its seconds in `stats.specialise_s`). Must be among
        `capture_sizes`. See `cgcompile.build.compiler`.""")
    inductor_options: tuple[tuple[str, Any], ...] = option((), _inductor_options, normalise=_as_option_pairs, doc="""
        Inductor config patches for every compile of a piece, as a dict (e.g.
        {"coordinate_descent_tuning": True}); stored as sorted (key, value) pairs. Autotuning
        options lengthen the warm-up: coordinate_descent_tuning benchmarks the tile sizes of every
        kernel, max_autotune_gemm the GEMM templates of every distinct shape. None are set by
        default; `combo_kernels` and `triton.enable_pdl` come from the options `combo_kernels` and
        `dependent_launch`, and a value here wins. Needs an Inductor compile: compiler="inductor", or a full graph that compiles.""")
    matvec_as_reduction: bool = option(False, _bool, doc="""
        Every bf16/fp16 linear whose input has exactly one row at static shapes is compiled as a
        multiply and a sum over the input features (one Inductor reduction, float32
        accumulation) instead of cuBLAS's matrix product. Static shapes: a graph Dynamo compiled
        for calls of one row (it specialises sizes of 1, so a batch-1 decode step has its own
        graph), and the compiles at `compile_sizes`. At one row a linear reads its
        whole weight for few outputs, and on an H200 the reduction read a 1B decoder's weights at
        60% of the copy bandwidth against cuBLAS's 41% (88% against 77% at 8B shapes with
        `size_inductor_options={"coordinate_descent_tuning": True}`; `benchmarks/gemv_bench.py`).
        At several rows it is slower, so only one-row linears change. Applies to the pieces'
        compiles, which the default full graph replays; a whole-graph compile
        (`full_graph_compile`) keeps cuBLAS. Needs compiler="inductor". See
        `cgcompile.passes.matvec_reduction`.""")
    skinny_linears: bool = option(True, _bool, doc="""
        Linears of one row (a batch-1 decode step), in bf16/fp16 on CUDA, run
        `cgcompile::skinny_linear`, a Triton kernel that reads each weight element once,
        instead of cuBLAS: faster than cuBLAS at every decoder shape measured on an H200,
        from 256 to 128256 output features (`benchmarks/skinny_sweep.py`,
        benchmarks/RESULTS.md). More rows keep cuBLAS, which was level or faster there. The
        products are found in Inductor's post-grad graph (`cgcompile.passes.skinny_linear`),
        so a DTensor model's shards are found too. Sums are in float32 as cuBLAS's are:
        results agree with eager to rounding, not bit for bit. One-row products of one input
        that stay separate (2 to 4: a DTensor model's q/k/v shards, unfused siblings) run in
        one launch (`cgcompile::grouped_skinny_linear`, `cgcompile.passes.skinny_groups`),
        and a gated MLP's down projection makes its input, `silu(gate) * up`, as it reads it
        (`cgcompile::silu_mul_linear`, `cgcompile.passes.silu_mul_linear`). Applies to the
        pieces' Inductor compiles (`compiler="inductor"`), which the default full graph
        replays; a whole-graph compile (`full_graph_compile`) keeps cuBLAS.""")
    decode_attention_kernel: bool = option(True, _bool, doc="""
        Where `small_query_attention` lowers a full graph's decode attention, bf16/fp16 calls
        on CUDA run `cgcompile::decode_attention` (split-K flash decoding: one or two Triton
        launches a layer, the cache read once per key head, blocks the mask hides from every row
        skipped) instead of the batched matmuls, softmax and layout copies. Scores are float32
        as in SDPA's fused kernels. Calls it cannot serve (float32, inputs that require grad,
        more than 64 query rows a key head, caches of more than 4096 positions, the longest
        measured) keep the matmuls. See
        `cgcompile.kernels.decode_attention`.""")
    size_inductor_options: tuple[tuple[str, Any], ...] = option(
        (), _inductor_options, normalise=_as_option_pairs, doc="""
        Patches for the `compile_sizes` compiles only, on top of `inductor_options`: where
        autotuning pays, since every shape there is fixed. Needs `compile_sizes`.""")
    combo_kernels: bool = option(True, _bool, doc="""
        Inductor's combo kernels (its `combo_kernels` option) in every compile: kernels of one
        compile that do not depend on each other run as one launch, e.g. a decoder layer's
        rotary embeddings of the queries and of the keys, or its two cache writes. A decode step
        is mostly such kernels of about a microsecond each; on an H200 a transformers Llama
        step took 6% less time at 1.1B and 3% less at 8B (batch 1, `benchmarks/hf_probe.py`,
        benchmarks/RESULTS.md). An explicit `inductor_options={"combo_kernels": ...}` wins.""")

    dependent_launch: bool = option(True, _bool, doc="""
        Inductor's programmatic dependent launch (its `triton.enable_pdl` option) in every
        compile: on Hopper and later GPUs (Inductor checks) each Triton kernel is launched while
        the kernel before it drains, so a step of many short kernels loses less time between
        them. cgcompile makes every such kernel wait for the one before it prior to its first
        load or store (`build/dependent_launch.py`): Inductor's own choice of where to wait let
        a kernel read stale memory on torch 2.11. On an H200 it took 5% off a 1.1B transformers
        Llama's decode step and 2.5% off the 8B shape (batch 1, `benchmarks/hf_probe.py`,
        benchmarks/RESULTS.md). cgcompile's own kernels launch so wherever the GPU has it,
        whatever this says. An explicit `inductor_options={"triton.enable_pdl": ...}` wins.""")

    def inductor_patches(self) -> dict[str, Any]:
        """The Inductor config patches of every compile: `inductor_options` over what the
        group's own options ask of Inductor."""
        return {"combo_kernels": self.combo_kernels, "triton.enable_pdl": self.dependent_launch,
                **dict(self.inductor_options)}


@_group
class Graphs(_Group):
    """How the pieces' CUDA graphs are captured, and what a replay returns."""

    cudagraphs: bool | None = option(None, _optional_bool, doc="""
        None: on when the graph's tensors are on CUDA.""")
    capture_error_mode: str = option("global", _choice("global", "thread_local", "relaxed"), doc="""
        torch's check for unsafe CUDA calls during capture: "global", "thread_local" (other
        threads, e.g. NCCL proxies, may use CUDA meanwhile) or "relaxed". Refused beside
        cudagraphs=False, as are `reuse_output_buffers` and `check_addresses`: nothing is captured.""")
    reuse_output_buffers: bool = option(False, _bool, doc="""
        Return the graphs' static output buffers instead of copies. Faster, but a later call
        overwrites outputs the caller still holds. Needs CUDA graphs (refused with cudagraphs=False).""")


@_group
class Rewrites(_Group):
    """Rewrites of the Dynamo graph made before it is split, and of the frame's guards. Results
    agree with eager to rounding, not bit for bit."""

    fold_grouped_query: bool = option(True, _bool, doc="""
        Where a one-token query meets KV heads repeated for grouped-query attention (`repeat_kv`),
        let SDPA read the un-repeated cache instead (see `cgcompile.passes.grouped_query`): two
        copies of the cache per layer and step fewer. False keeps the model's own attention
        calls.""")
    fuse_sibling_linears: bool | None = option(None, _optional_bool, doc="""
        Linear layers that read the same input with parameter weights (q/k/v projections, gate and
        up) run as one matmul over their concatenated weights (see
        `cgcompile.passes.sibling_linears`): at decode sizes small projections run far below the
        GPU's bandwidth, and one larger matmul does not. None (the default): on CUDA, fuse the
        groups whose fused weight can take the parameters' place, so that fusing adds no memory;
        each parameter becomes a view of its rows of the fused weight (its address moves once,
        when its first graph compiles; `stats.shared_fused_weights`), and a group that cannot
        share (tied weights, a kept `param.data`, a parameter that is a view of a larger tensor,
        a DTensor) stays unfused, with the reason logged. True: fuse those too, on any device,
        through a copy of their weights (`stats.fused_weight_bytes`) kept equal to the
        parameters on every call (`cgcompile.run.fused_weights`; a write through `param.data` to
        such a parameter is not seen: call `Backend.refresh_fused_weights()`). False: never.
        Parameters that require grad are left out while grad is on (the fused weight would take
        their gradients).""")
    all_reduce: str = option("auto", _choice("auto", "symm_mem", "nccl"), doc="""
        Which all-reduce a sum over a functional collective gets in a graph on CUDA: "auto" routes
        it, where its process group allows (NCCL ranks on one host with P2P), to cgcompile's
        barrier-free Lamport kernel up to 64 KiB (Triton; `cgcompile.parallel.lamport_all_reduce`),
        then torch symmetric memory's one-shot and two-shot kernels, and NCCL for large messages
        and elsewhere (see `cgcompile.parallel.fast_all_reduce` and docs/parallel.md); "symm_mem"
        is the same without the Lamport kernel; "nccl" keeps the model's collectives as they are.
        A group's choice is made at its first set-up: to be sure, call
        `prepare_collectives(device, group, all_reduce=...)` before compiling.""")
    fuse_all_reduce_norm: bool = option(True, _bool, doc="""
        Where a routed all-reduce's sum is added to a residual and RMS-normalised (every
        tensor-parallel pre-norm layer, twice), and its group runs the Lamport kernel, the three
        run as one kernel in compiles whose sizes are fixed at decode sizes (up to 8 rows, hidden
        size up to 8192): a batch-1 step's graph, `dynamic=False`, `compile_sizes`. Compiles for
        several sizes keep the three apart. Results agree with the unfused graph's to rounding
        (the norm's sum runs in another order). Inductor pieces only; see
        `cgcompile.parallel.all_reduce_norm`.""")
    fuse_linear_all_reduce: bool = option(False, _bool, doc="""
        Where such a fused all-reduce's only input is a one-row product on the skinny kernel
        (`skinny_linears`: a batch-1 step's row-parallel output or down projection), the
        product writes its row into every rank's Lamport slots itself, and the all-reduce's
        kernel only gathers, adds and normalises. Results are those of the pair apart, bit
        for bit. Off by default: on 4 H200s it took 1-2% off a Megatron-style decoder's step
        (`TensorParallelDecoder`, TP=2 and 4), while transformers' `tp_plan` Llama ran 2-5%
        slower with it in both runs, for a reason not yet found. Needs
        `fuse_all_reduce_norm` and `skinny_linears`.""")
    dtensor_spec_guards: str = option("cgcompile", _choice("cgcompile", "dynamo"), doc="""
        Who checks the DTensor specs (mesh, placements) of a graph's DTensor parameters at every
        call. "cgcompile": the graph's runtime compares them (by identity while the spec objects
        stay, a few microseconds for hundreds of parameters), and Dynamo's own spec guards on
        those parameters, a Python call each at every call, are taken out of the frame's guards;
        a resharded parameter then raises `CGCompileError` instead of compiling again.
        "dynamo": keep Dynamo's guards, so that resharding compiles again. See
        `cgcompile.parallel.dtensor_guards`.""")


@_group
class FullGraphOptions(_Group):
    """One CUDA graph of the whole Dynamo graph, split ops included. A call replays it when every
    host value and every input address the split ops read equals the captured one, else it runs
    piecewise (see `cgcompile.run.full_graph`). `Config.full_graph` is "auto" by default: each graph
    that runs with CUDA graphs and has an eager piece gets `FullGraphOptions(small_query_attention=True)`
    (without small_query_attention under compiler="eager"), any other graph none (see
    `Config.full_graph_for`); None turns full graphs off. The options exist only inside this
    record, so none can be set without it. The fields were once named `split_ops` and `compile`:
    those names are still accepted here, with a DeprecationWarning."""

    _RENAMED = {"split_ops": "capturable_split_ops", "compile": "full_graph_compile"}

    capturable_split_ops: tuple[Any, ...] = option(("attention",), _capturable_ops, normalise=_as_tuple, doc="""
        Split ops that may be captured into the full graph: "attention" (every form of
        scaled-dot-product attention), op objects or "ns::op[.overload]" (see `cgcompile.ops`).
        At least one.""")
    full_graph_compile: bool = option(False, _bool, doc="""
        Capture the whole Dynamo graph compiled by Inductor at its size (fused across what are
        piece boundaries), at the cost of one compile of the whole graph per captured size, made at
        that size's first capture (counted in `stats.full_graph_compilations`, its seconds in
        `stats.full_graph_compile_s`). With compiler="eager" beside it, that is the only compile:
        piecewise calls (a prefill) run the pieces as FX code. False: the full graph captures the
        pieces' own code in order, with no compile beyond theirs.""")
    small_query_attention: bool = option(False, _bool, doc="""
        Attention calls of at most 16 query rows (decode) are compiled as two batched matmuls
        around a float32 softmax, which spread over the whole GPU, instead of SDPA's kernels, which
        walk the keys with one thread block per head (precision that of Hugging Face's eager
        attention): inside the whole-graph compile with `full_graph_compile`, else by compiling
        each eager piece that holds such a call at the shapes of its capture (identical layers
        share one compile). Piecewise calls are unchanged. Needs compiler="inductor" or
        `full_graph_compile=True`. See `cgcompile.passes.small_query`.""")

    def __post_init__(self) -> None:
        super().__post_init__()
        expect(len(self.capturable_split_ops) > 0, "capturable_split_ops",
               "at least one split op the full graph may capture", self.capturable_split_ops,
               'write FullGraphOptions(capturable_split_ops=("attention",)), or full_graph=None for no full graphs',
               ConfigError)

    @functools.cached_property
    def capturable_ops(self) -> CapturableOps:
        return CapturableOps(frozenset(_capturable("capturable_split_ops", op) for op in self.capturable_split_ops))


def automatic_full_graph(compiler: str) -> FullGraphOptions:
    """What `full_graph="auto"` gives a graph that runs with CUDA graphs: attention captured
    into the full graph, and decode attention lowered to batched matmuls where Inductor
    compiles (small_query_attention needs a compile; with compiler="eager" nothing does).

    Why this is sound as a default: a call replays the full graph only when every host
    value and input address attention reads equals the captured one, and a full graph is
    captured only on the second consecutive call of a size with the same key
    (`cgcompile.run.full_graph`); a model whose cache length changes every step never
    captures one and runs piecewise, as without it."""
    return FullGraphOptions(capturable_split_ops=("attention",), small_query_attention=compiler == "inductor")


@_group
class Debug(_Group):
    """Checks and dumps for finding out what cgcompile did."""

    dump_dir: str | None = option(None, _dump_dir, doc="""
        Write graphs and a split summary here (or set CGCOMPILE_DUMP_DIR); "~" is expanded, and a
        path that cannot be a writable folder is refused at once. Each Backend dumps into a folder
        of its own: `DUMP_DIR` itself for the first, the first free `DUMP_DIR/run_<n>` for any
        later one (see `cgcompile.tools.dump.claim_run_folder`).""")
    check_addresses: bool = option(False, _bool, doc="""
        On every replay, check that inputs captured by address still live there, and raise naming
        the piece and input if not. Without it, a call whose parameters moved runs without graphs
        and graphs are captured again once the new addresses settle (`cgcompile.run.weights`). Needs CUDA
        graphs (refused with cudagraphs=False).""")


@_group
class Manager(_Group):
    """What `GraphManager` runs."""

    use_breakable: bool = option(False, _bool, doc="""
        The manager's default path: breakable CUDA graphs instead of compiled pieces; the
        CGCOMPILE_USE_BREAKABLE environment variable (0 or 1) overrides it. Only a `GraphManager`
        reads it: a `Backend` and torch.compile's options, which always run compiled pieces,
        refuse True.""")


# -- Config ------------------------------------------------------------------------------


class _Unset:
    def __repr__(self) -> str:
        return "<its defaults>"


_UNSET = _Unset()


def _part(cls: type, optional: bool = False) -> Any:
    """A Config field holding one group: its defaults; where `optional`, AUTO (resolved per
    graph, see `Config.full_graph_for`), and None is accepted for off."""
    if optional:
        return dataclasses.field(default=AUTO, metadata={"group": cls, "optional": True})
    return dataclasses.field(default_factory=cls, metadata={"group": cls})


def _init_signature(parts: dict[str, dataclasses.Field]) -> inspect.Signature:
    """Config.__init__'s signature: each group's fields by their (flat) names with their
    defaults, then the groups themselves."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    flat = [inspect.Parameter(f.name, keyword, default=f.default)
            for part in parts.values() for f in dataclasses.fields(part.metadata["group"])]
    groups = [inspect.Parameter(name, keyword, default=AUTO if part.metadata.get("optional") else _UNSET)
              for name, part in parts.items()]
    return inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *flat, *groups])


@dataclasses.dataclass(frozen=True, init=False)
class Config:
    """How cgcompile splits, compiles and captures a model: one frozen record per concern.

    Write it with the flat names, as the torch.compile options dict does:
    `Config(capture_sizes=(1, 2, 4, 8), compiler="eager")`; or by group:
    `Config(sizes=Sizes(capture_sizes=(1, 2, 4, 8)))`, where a group may also be a dict of
    its fields. Flat names given beside their group are applied on top of it, so
    `dataclasses.replace(config, compiler="eager")` works. Each flat name is an alias of the
    group field of the same name, for writing a Config only (here and in torch.compile's
    options dict): read it through its group, `config.sizes.capture_sizes` (a flat read raises
    AttributeError saying so).

    The full-graph options exist only inside `full_graph`. Its default, "auto", gives every
    graph that runs with CUDA graphs a full graph with attention captured and decode attention
    lowered (`full_graph_for`); graphs without CUDA graphs (CPU) stay piecewise, and
    `full_graph=None` (or flat `capturable_split_ops=()`) keeps every graph piecewise. Written
    out: `Config(full_graph=FullGraphOptions(full_graph_compile=True))`, or flat,
    `Config(capturable_split_ops=("attention",), full_graph_compile=True)`; flat full-graph
    names replace the automatic default. A full-graph option without `capturable_split_ops` is
    refused: there would be no full graph to apply it to. So is any option that would be
    ignored: `capture_input_dim` without `capture_input`, the capture options with
    `cudagraphs=False`, and `use_breakable=True` anywhere but a `GraphManager`. Unknown names,
    wrong types and values that cannot work together raise ConfigError when the Config is built.
    """

    split: Split = _part(Split)
    sizes: Sizes = _part(Sizes)
    compile: Compile = _part(Compile)
    graphs: Graphs = _part(Graphs)
    rewrites: Rewrites = _part(Rewrites)
    full_graph: FullGraphOptions | str | None = _part(FullGraphOptions, optional=True)  # AUTO, a record, None
    debug: Debug = _part(Debug)
    manager: Manager = _part(Manager)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_names("Config", args, kwargs, _NAMES)
        for part in dataclasses.fields(self):
            flat = {field: kwargs[name] for name, (group, field) in FLAT_NAMES.items()
                    if group == part.name and name in kwargs}
            object.__setattr__(self, part.name, _build_part(part, kwargs.get(part.name, _UNSET), flat))
        _check_across_parts(self)

    # what help(Config) and editors show: every flat name and every group, by keyword
    __init__.__signature__ = _init_signature(dict(
        split=split, sizes=sizes, compile=compile, graphs=graphs, rewrites=rewrites, full_graph=full_graph,
        debug=debug, manager=manager))

    def __getattr__(self, name: str) -> Any:
        # Reached only for names Config lacks. A flat name is for writing a Config; say where
        # its value is read instead of a bare AttributeError.
        if name not in FLAT_NAMES:
            raise AttributeError(f"'Config' object has no attribute {name!r}")
        part, field = FLAT_NAMES[name]
        where = (f"config.full_graph_for(cudagraphs=True).{field} (full_graph is 'auto', None or a FullGraphOptions)"
                 if part == "full_graph" else f"config.{part}.{field}")
        raise AttributeError(expected(f"config.{name}", "a read through its group", "the flat name",
                                      f"read {where}; flat names are for Config(...) and torch.compile options",
                                      raw=True))

    @functools.cached_property
    def split_ops(self) -> SplitOps:
        """Where graphs split: the default split ops plus `split.splitting_ops`."""
        return SplitOps(frozenset(normalize_op(_held_op(op)) for op in self.split.splitting_ops))

    def full_graph_for(self, cudagraphs: bool) -> FullGraphOptions | None:
        """The full-graph options of a graph that runs with CUDA graphs on or off: `full_graph`
        as written, or where it is "auto" (the default), `automatic_full_graph` with graphs on
        and None without. Every reader in the engine asks here, with its graph's own
        `cudagraphs`: a graph on CPU never sees the automatic options."""
        if self.full_graph != AUTO:
            return self.full_graph
        return automatic_full_graph(self.compile.compiler) if cudagraphs else None

    @property
    def max_capture_size(self) -> int:
        return max(self.sizes.capture_sizes)

    def pads(self, cudagraphs: bool) -> bool:
        """Whether calls are padded to the capture sizes, for a graph with graphs on or off."""
        return cudagraphs if self.sizes.padding is None else self.sizes.padding

    def resolved_dump_dir(self) -> str | None:
        """`dump_dir`, or the CGCOMPILE_DUMP_DIR environment variable (read here only), with
        "~" expanded; a path that cannot be a writable folder raises ConfigError."""
        if self.debug.dump_dir:
            return os.path.expanduser(os.fspath(self.debug.dump_dir))
        value = os.environ.get(DUMP_DIR_ENV)
        return check_dump_dir(DUMP_DIR_ENV, value) if value else None

    def resolved_use_breakable(self) -> bool:
        """`use_breakable`, unless CGCOMPILE_USE_BREAKABLE=0/1 overrides it.

        `as_config` calls it when a Backend or GraphManager is built, so a malformed value
        is refused on every path, not only on the one that uses it.
        """
        value = self.use_breakable_override()
        return self.manager.use_breakable if value is None else value == "1"

    def use_breakable_override(self) -> str | None:
        """CGCOMPILE_USE_BREAKABLE ("0" or "1", read here only) when it is set, else None;
        messages about the path name it, since it wins over `use_breakable`."""
        value = os.environ.get(USE_BREAKABLE_ENV)
        if value is None or value == "":
            return None
        expect(value in ("0", "1"), USE_BREAKABLE_ENV, "0 or 1", value,
               f"unset it or write {USE_BREAKABLE_ENV}=1 for breakable graphs, 0 for compiled pieces", ConfigError)
        return value

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "Config":
        """Build from `torch.compile(..., options={...})`: the keys are Config's flat names or
        groups, checked exactly as `Config(**options)` checks them (lists accepted for tuples).
        `use_breakable=True` is refused: torch.compile runs compiled pieces, never the
        breakable path a GraphManager chooses with it."""
        expect(options is None or isinstance(options, Mapping), "options", "a dict of Config fields", options,
               "write options={'compiler': 'eager'}", ConfigError)
        options = dict(options or {})
        _check_names("options", (), options, _NAMES)
        config = cls(**options)
        _refuse_use_breakable(config, "options", "torch.compile runs compiled pieces",
                              "remove it from options")
        return config


def _build_part(part: dataclasses.Field, given: Any, flat: dict[str, Any]) -> Any:
    """One group of a Config: the one given (a record or a dict of its fields) or the
    defaults, with the flat names given beside it applied on top."""
    cls = part.metadata["group"]
    if part.metadata.get("optional"):
        return _full_graph(_given_part(part.name, cls, given, optional=True), flat)
    base = cls() if given is _UNSET else _given_part(part.name, cls, given)
    return dataclasses.replace(base, **flat) if flat else base


def _given_part(name: str, cls: type, value: Any, optional: bool = False) -> Any:
    if optional and (value is _UNSET or (isinstance(value, str) and value == AUTO)):
        return AUTO
    if optional and value is None:
        return None
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls(**value)
    wanted = f"a {cls.__name__}{f', None, {AUTO!r}' if optional else ''} or a dict of its fields"
    raise ConfigError(expected(name, wanted, value, f"write {name}=cgcompile.config.{cls.__name__}(...)"))


def _full_graph(given: FullGraphOptions | str | None, flat: dict[str, Any]) -> FullGraphOptions | str | None:
    """The full-graph record, from `full_graph=` with the flat names on top: None when no
    split op may be captured, and then no other full-graph option may be set (it would
    be ignored). Flat names replace AUTO: they are applied on top of no full graph, so an
    option written alone is refused, as it is with `full_graph=None`."""
    if not flat:
        return given
    fields = {f.name: f for f in dataclasses.fields(FullGraphOptions)}
    explicit = isinstance(given, FullGraphOptions)
    values = {**({n: getattr(given, n) for n in fields} if explicit else _FULL_GRAPH_OFF), **flat}
    ops = values["capturable_split_ops"]
    if not (isinstance(ops, (tuple, list)) and len(ops) == 0):
        return FullGraphOptions(**values)
    ignored = {n: v for n, v in values.items() if n != "capturable_split_ops" and v != _FULL_GRAPH_OFF[n]}
    for name, value in ignored.items():  # a wrong type is named as such first
        _check_value(fields[name], name, value)
    given_text = ", ".join(f"{n}={v!r}" for n, v in ignored.items())
    expect(not ignored, ", ".join(ignored), "capturable_split_ops beside it (the split ops a full graph may "
           "capture; without them there is no full graph to apply it to)",
           f"{given_text} without capturable_split_ops",
           f'add capturable_split_ops=("attention",), or leave {" and ".join(ignored)} out', ConfigError, raw=True)
    return None


def _check_value(field: dataclasses.Field, culprit: str, value: Any) -> None:
    field.metadata["check"](culprit, field.metadata["normalise"](culprit, value))


def _check_across_parts(config: Config) -> None:
    """The checks that read two groups: each group has checked its own fields."""
    _check_compile_sizes(config.compile.compile_sizes, config.sizes.capture_sizes)
    full = config.full_graph_for(cudagraphs=True)  # the automatic options are chosen to pass these
    expect(full is None or not full.small_query_attention or full.full_graph_compile
           or config.compile.compiler == "inductor",
           "small_query_attention", 'compiler="inductor" or full_graph_compile=True beside it (the lowered '
           'attention is compiled)', f"compiler={config.compile.compiler!r}",
           'set compiler="inductor" or full_graph_compile=True, or leave small_query_attention out',
           ConfigError, raw=True)
    expect(not config.compile.matvec_as_reduction or config.compile.compiler == "inductor",
           "matvec_as_reduction", 'compiler="inductor" (it rewrites what Inductor compiles)',
           f"compiler={config.compile.compiler!r}", 'set compiler="inductor", or leave it off', ConfigError, raw=True)
    # Options that only patch a compile nothing makes would be dropped silently.
    expect(config.compile.compile_sizes or not config.compile.size_inductor_options, "size_inductor_options",
           "compile_sizes beside it (these options patch only the compiles at those sizes)",
           "size_inductor_options without compile_sizes",
           "add compile_sizes=(...) from capture_sizes, or move the options to inductor_options",
           ConfigError, raw=True)
    inductor = config.compile.compiler == "inductor" or (
        full is not None and (full.full_graph_compile or full.small_query_attention))
    expect(inductor or not config.compile.inductor_options, "inductor_options",
           'an Inductor compile to patch (compiler="inductor", or a full graph with full_graph_compile or '
           "small_query_attention)", f"compiler={config.compile.compiler!r} and no full-graph compile",
           'set compiler="inductor", or leave inductor_options out', ConfigError, raw=True)
    _check_capture_options(config)


# Options that act on captured CUDA graphs only: (group, field).
_CAPTURE_OPTIONS = (("graphs", "reuse_output_buffers"), ("graphs", "capture_error_mode"), ("debug", "check_addresses"))
_DEFAULTS = {f.name: f.default for group in (Graphs, Debug) for f in dataclasses.fields(group)}


def _check_capture_options(config: Config) -> None:
    """With cudagraphs=False nothing is captured: a capture option set beside it would be ignored."""
    if config.graphs.cudagraphs is not False:
        return
    written = {name: getattr(getattr(config, part), name) for part, name in _CAPTURE_OPTIONS}
    given = {name: value for name, value in written.items() if value != _DEFAULTS[name]}
    given_text = ", ".join(f"{name}={value!r}" for name, value in given.items())
    expect(not given, ", ".join(given), "cudagraphs=None or True beside it (it acts on captured CUDA graphs: "
           "their static outputs, their capture, their input addresses)", f"{given_text} with cudagraphs=False",
           f"leave {' and '.join(given)} out, or drop cudagraphs=False", ConfigError, raw=True)


def _check_names(culprit: str, args: tuple, kwargs: Mapping, names: list[str]) -> None:
    """Refuse positional arguments and unknown names, listing the names and the nearest one."""
    if args:
        raise ConfigError(expected(culprit, "keyword arguments only", f"{len(args)} positional argument(s)",
                                   f"write {culprit}(field=value); the fields are {names}", raw=True))
    for name in kwargs:
        if name not in names:
            hint = closest(name, names)
            fix = f"{hint} The fields are {names}." if hint else f"the fields are {names}"
            what = "a Config field" if culprit in ("Config", "options") else f"a {culprit} field"
            raise ConfigError(expected(culprit, what, f"unknown {name!r}", fix, raw=True))


# Every flat name (the keywords of Config(...) and the options dict), mapped to (the Config
# field of its group, its name in the group): the same name, one group each.
FLAT_NAMES: dict[str, tuple[str, str]] = {
    field.name: (part.name, field.name)
    for part in dataclasses.fields(Config) for field in dataclasses.fields(part.metadata["group"])
}
_NAMES = [*FLAT_NAMES, *(part.name for part in dataclasses.fields(Config))]
# Flat full-graph names are applied on top of these: no capturable ops, every other option at its default.
_FULL_GRAPH_OFF = {**{f.name: f.default for f in dataclasses.fields(FullGraphOptions)}, "capturable_split_ops": ()}


def as_config(config: Any, culprit: str) -> Config:
    """The `config` argument of an entry point (a Config, or None for the defaults), with the
    environment checked too: a malformed CGCOMPILE_USE_BREAKABLE is refused on every path."""
    fix = "write Config(**options) or Config.from_options(options)" if isinstance(config, Mapping) else ""
    expect(config is None or isinstance(config, Config), f"{culprit}: config", "a cgcompile.Config or None",
           config, fix, ConfigError)
    config = config or Config()
    if culprit != "GraphManager":  # the manager hands its Backend a Config without it
        _refuse_use_breakable(config, culprit, f"a {culprit} runs compiled pieces", "leave it out of this Config")
    config.resolved_use_breakable()
    config.resolved_dump_dir()
    return config


def _refuse_use_breakable(config: Config, culprit: str, why: str, fix: str) -> None:
    """`use_breakable=True` reaches only a GraphManager: anywhere else it would be ignored."""
    expect(not config.manager.use_breakable, f"{culprit}: use_breakable", f"False ({why}; use_breakable "
           "chooses a GraphManager's path)", True,
           f"{fix}, and for breakable CUDA graphs write cgcompile.GraphManager(model, "
           "cgcompile.Config(use_breakable=True))", ConfigError)


def check_dump_dir(culprit: str, path: Any) -> str:
    """`path` with "~" expanded, checked to be a folder cgcompile can make and write now.

    Nothing is left behind: the nearest existing folder on the path gets a probe folder
    that is removed at once (permission bits alone cannot tell: /proc is writable to root
    by its bits, but nothing can be made there)."""
    folder = os.path.expanduser(os.fspath(path))
    existing = os.path.abspath(folder)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    fix = "choose a folder you can write, e.g. dump_dir='~/cgcompile_dump'"
    if not os.path.isdir(existing):
        where = "a file" if existing == os.path.abspath(folder) else f"a path under the file {existing!r}"
        raise ConfigError(expected(culprit, "a folder path", f"{path!r}, {where}", fix, raw=True))
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".cgcompile_probe_", dir=existing))
    except OSError as e:
        raise ConfigError(expected(culprit, "a folder cgcompile can create and write",
                                   f"{path!r} ({e.strerror} in {existing!r})", fix, raw=True)) from e
    return folder
