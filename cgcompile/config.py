"""The one frozen configuration object, validated when it is built."""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
import os
import tempfile
import types
import typing
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .errors import ConfigError, closest, expect, expected
from .ops import CapturableOps, normalize_capturable
from .ops import SplitOps, normalize_op

DEFAULT_CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 257, 8))
COMPILERS = ("eager", "inductor")
DUMP_DIR_ENV = "CGCOMPILE_DUMP_DIR"
USE_BREAKABLE_ENV = "CGCOMPILE_USE_BREAKABLE"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """How cgcompile splits, compiles and captures a model.

    splitting_ops: ops to split at besides the defaults (attention in every form,
        flash-attn ops, ops tagged `cudagraph_unsafe`): op objects (what
        `@torch.library.custom_op` returns too) or "ns::op[.overload]".
    capture_sizes: sizes of the capture dimension that get a CUDA graph; a call of size n
        runs padded to the smallest capture size >= n. Any order, any int type (numpy's
        too): stored as sorted Python ints, as compile_sizes is.
    compiler: "eager" runs capturable pieces as FX code; "inductor" compiles each once.
    cudagraphs: None = on when the graph's tensors are on CUDA.
    dump_dir: write graphs and a split summary here (or set CGCOMPILE_DUMP_DIR); "~" is
        expanded, and a path that cannot be a writable folder is refused at once. Each
        Backend dumps into a folder of its own: DUMP_DIR itself for the first, the first
        free DUMP_DIR/run_<n> for any later one (see `cgcompile.dump.claim_run_folder`).
    capture_input / capture_input_dim: override which graph input's dimension is the
        capture dimension (see `cgcompile.passes.find_capture_dim` for the default rule).
        The input is named as in the model's forward, e.g. "input_ids".
    reuse_output_buffers: return the graphs' static output buffers instead of copies.
        Faster, but a later call overwrites outputs the caller still holds.
    check_addresses: on every replay, check that inputs captured by address still live
        there, and raise naming the piece and input if not. Without it, a call whose
        parameters moved runs without graphs and graphs are captured again once the new
        addresses settle (`cgcompile.weights`).
    cudnn_attention: let scaled_dot_product_attention in the eager pieces use its cuDNN
        backend. Off by default: cuDNN builds a plan for every new key length (tens of
        ms each, then a host-side lookup per call), and split attention sees a new
        length at every decode step. See `cgcompile.ops`.
    fold_grouped_query: where a one-token query meets KV heads repeated for grouped-query
        attention (`repeat_kv`), let SDPA read the un-repeated cache instead (see
        `cgcompile.passes.grouped_query`): two copies of the cache per layer and step
        fewer. Results agree with eager to rounding, not bit for bit; False keeps the
        model's own attention calls.
    fuse_sibling_linears: linear layers that read the same input with parameter weights
        (q/k/v projections, gate and up) run as one matmul over their concatenated
        weights (see `cgcompile.passes.sibling_linears`): at decode sizes small
        projections run far below the GPU's bandwidth, and one larger matmul does not.
        Costs memory: the concatenated weights are copies (`stats.fused_weight_bytes`),
        kept equal to the parameters on every call (`cgcompile.weights`; a write
        through `param.data` is not seen: call `Backend.refresh_fused_weights()`).
        Results agree with eager to rounding. For inference: with grad on, parameters
        that require grad are left out.
    capture_error_mode: torch's check for unsafe CUDA calls during capture: "global",
        "thread_local" (other threads, e.g. NCCL proxies, may use CUDA meanwhile) or "relaxed".
    use_breakable: the manager's default path (breakable CUDA graphs instead of compiled
        pieces); the CGCOMPILE_USE_BREAKABLE environment variable overrides it.
    padding: None pads calls to the capture sizes when CUDA graphs are on; True pads
        them even without graphs (on CPU too: how the tests exercise padding); False never
        pads (every graph is captured at the exact sizes seen). A Dynamo graph whose
        capturable code mixes rows along the capture dimension is never padded, whatever
        this says (see `cgcompile.passes.padding_safety`). Breakable graphs, which have no
        graph to check, pad only with True: the user's word that rows never mix.
    capturable_split_ops: split ops that may be captured into one full graph of the whole
        Dynamo graph ("attention", op objects or "ns::op[.overload]"; see
        `cgcompile.ops`). A call replays the full graph when every host value
        and every input address the split ops read equals the captured one, else it runs
        piecewise (see `cgcompile.full_graph`). Empty (the default): always piecewise.
    full_graph_compile: a full graph captures the whole Dynamo graph compiled by Inductor
        at its size (fused across what are piece boundaries), at the cost of one compile
        of the whole graph per captured size, made at that size's first capture (counted
        in `stats.full_graph_compilations`, its seconds in `stats.full_graph_compile_s`).
        With compiler="eager" beside it, that is the only compile: piecewise calls (a
        prefill) run the pieces as FX code, and the warm-up is one compile, not two.
        False: a full graph captures the pieces' own code in order, with no compile
        beyond theirs. See `cgcompile.full_graph`.
    small_query_attention: in full graphs, attention calls of at most 16 query rows
        (decode) are compiled as two batched matmuls around a float32 softmax, which
        spread over the whole GPU, instead of SDPA's kernels, which walk the keys with
        one thread block per head (H100: 0.77x reduce-overhead's decode step on a 1B
        decoder at batch 1; precision that of Hugging Face's eager attention):
        inside the whole-graph compile with full_graph_compile, else by compiling each
        eager piece that holds such a call at the shapes of its capture (identical
        layers share one compile). Piecewise calls are unchanged. Needs compiler="inductor"
        or full_graph_compile. See `cgcompile.passes.small_query`, `cgcompile.full_graph`.
    exact_size_limit: a graph that runs at exact sizes (padding off, or unsafe to pad)
        captures one set of CUDA graphs per distinct size: for each capture size, and for
        at most this many other sizes; calls of further new sizes run its pieces without
        graphs (logged once).
    compile_sizes: capture sizes whose pieces are also compiled with the capture dimension
        fixed (Inductor can then pick kernels for that exact shape, e.g. a matrix-vector
        product at size 1); the graphs of those sizes replay the specialised code, other
        sizes the general compile. Each adds one compile per distinct piece, at the first
        call of that size (counted in `stats.specialised_compilations`, its seconds in
        `stats.specialise_s`). See `cgcompile.compiler`.
    inductor_options: Inductor config patches for every compile of a piece, as a dict
        (e.g. {"coordinate_descent_tuning": True}); stored as sorted (key, value) pairs.
        Warm-up cost: coordinate_descent_tuning benchmarks tile sizes of every kernel
        (seconds per distinct piece); max_autotune_gemm benchmarks GEMM templates (tens
        of seconds per distinct GEMM shape). None are set by default.
    size_inductor_options: patches for the compile_sizes compiles only, on top of
        inductor_options: where autotuning pays, since every shape there is fixed.
    """

    splitting_ops: tuple[Any, ...] = ()
    capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    compiler: str = "inductor"
    cudagraphs: bool | None = None
    dump_dir: str | None = None
    capture_input: str | None = None
    capture_input_dim: int = 0
    reuse_output_buffers: bool = False
    check_addresses: bool = False
    use_breakable: bool = False
    capture_error_mode: str = "global"
    cudnn_attention: bool = False
    fold_grouped_query: bool = True
    fuse_sibling_linears: bool = False
    padding: bool | None = None
    exact_size_limit: int = 32
    compile_sizes: tuple[int, ...] = ()
    inductor_options: tuple[tuple[str, Any], ...] = ()
    size_inductor_options: tuple[tuple[str, Any], ...] = ()
    capturable_split_ops: tuple[Any, ...] = ()
    full_graph_compile: bool = False
    small_query_attention: bool = False

    def __new__(cls, *args, **kwargs):
        # Runs before the dataclass's generated __init__, so a misspelt or positional
        # argument gets a ConfigError that lists the fields, not the dataclass's TypeError.
        _check_field_names("Config", args, kwargs)
        return super().__new__(cls)

    def __post_init__(self):
        for name in _TUPLE_FIELDS:  # lists are accepted and stored as tuples (hashable, frozen)
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in _SIZE_FIELDS:  # numpy ints become ints; sizes are kept sorted (the order means nothing)
            object.__setattr__(self, name, _sorted_sizes(getattr(self, name)))
        for name in _OPTION_FIELDS:  # dicts are accepted and stored as sorted pairs (hashable)
            if isinstance(getattr(self, name), Mapping):
                object.__setattr__(self, name, _as_pairs(name, getattr(self, name)))
        for field in dataclasses.fields(self):
            _FIELD_CHECKS[field.name](field.name, getattr(self, field.name))
        _check_compile_sizes(self.compile_sizes, self.capture_sizes)
        expect(self.compiler == "inductor" or self.full_graph_compile or not self.small_query_attention,
               "small_query_attention", 'compiler="inductor" or full_graph_compile=True beside it (the lowered '
               'attention is compiled)', f"compiler={self.compiler!r}",
               'set compiler="inductor" or full_graph_compile=True, or leave small_query_attention out',
               ConfigError, raw=True)
        self.split_ops  # validates every splitting op name now, not at the first compile
        self.capturable_ops

    @functools.cached_property
    def split_ops(self) -> SplitOps:
        return SplitOps(frozenset(normalize_op(_held_op(op)) for op in self.splitting_ops))

    @functools.cached_property
    def capturable_ops(self) -> CapturableOps:
        return CapturableOps(frozenset(_capturable(op) for op in self.capturable_split_ops))

    @property
    def max_capture_size(self) -> int:
        return max(self.capture_sizes)

    def pads(self, cudagraphs: bool) -> bool:
        """Whether calls are padded to the capture sizes, for a graph with graphs on or off."""
        return cudagraphs if self.padding is None else self.padding

    def resolved_dump_dir(self) -> str | None:
        """`dump_dir`, or the CGCOMPILE_DUMP_DIR environment variable (read here only), with
        "~" expanded; a path that cannot be a writable folder raises ConfigError."""
        if self.dump_dir:
            return os.path.expanduser(os.fspath(self.dump_dir))
        value = os.environ.get(DUMP_DIR_ENV)
        return check_dump_dir(DUMP_DIR_ENV, value) if value else None

    def resolved_use_breakable(self) -> bool:
        """`use_breakable`, unless CGCOMPILE_USE_BREAKABLE=0/1 overrides it (read here only).

        `as_config` calls it when a Backend or GraphManager is built, so a malformed value
        is refused on every path, not only on the one that uses it.
        """
        value = os.environ.get(USE_BREAKABLE_ENV)
        if value is None or value == "":
            return self.use_breakable
        expect(value in ("0", "1"), USE_BREAKABLE_ENV, "0 or 1", value,
               f"unset it or write {USE_BREAKABLE_ENV}=1 for breakable graphs, 0 for compiled pieces", ConfigError)
        return value == "1"

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "Config":
        """Build from `torch.compile(..., options={...})`: the keys are Config's fields,
        checked exactly as `Config(**options)` checks them (lists accepted for tuples)."""
        expect(options is None or isinstance(options, Mapping), "options", "a dict of Config fields", options,
               "write options={'compiler': 'eager'}", ConfigError)
        options = dict(options or {})
        _check_field_names("options", (), options)
        return cls(**options)


_TUPLE_FIELDS = ("splitting_ops", "capture_sizes", "compile_sizes", "capturable_split_ops")
_SIZE_FIELDS = ("capture_sizes", "compile_sizes")
_OPTION_FIELDS = ("inductor_options", "size_inductor_options")


def as_config(config: Any, culprit: str) -> Config:
    """The `config` argument of an entry point (a Config, or None for the defaults), with the
    environment checked too: a malformed CGCOMPILE_USE_BREAKABLE is refused on every path."""
    fix = "write Config(**options) or Config.from_options(options)" if isinstance(config, Mapping) else ""
    expect(config is None or isinstance(config, Config), f"{culprit}: config", "a cgcompile.Config or None",
           config, fix, ConfigError)
    config = config or Config()
    config.resolved_use_breakable()
    config.resolved_dump_dir()
    return config


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


def _held_op(op: Any) -> Any:
    """The op object behind what `@torch.library.custom_op` returns (a CustomOpDef, the
    object the user holds), else `op` itself."""
    overload = getattr(op, "_opoverload", None)
    return overload if isinstance(overload, torch._ops.OpOverload) else op


def _capturable(entry: Any) -> str:
    # normalize_op's own message would only ask for "ns::op"; a bare word is most likely
    # a name for attention, which has its own keyword here.
    expect(not isinstance(entry, str) or "::" in entry or entry == "attention", "capturable_split_ops",
           '"attention" (every form of scaled-dot-product attention), an op object or "ns::op[.overload]"',
           entry, 'write capturable_split_ops=("attention",) for SDPA', ConfigError)
    return normalize_capturable(_held_op(entry))


def _check_field_names(culprit: str, args: tuple, kwargs: dict) -> None:
    """Refuse positional arguments and unknown names, listing the fields and the nearest one."""
    fields = [f.name for f in dataclasses.fields(Config)]
    if args:
        raise ConfigError(expected(culprit, "keyword arguments only", f"{len(args)} positional argument(s)",
                                   f"write Config(field=value); the fields are {fields}", raw=True))
    for name in kwargs:
        if name not in fields:
            hint = closest(name, fields)
            fix = f"{hint} The fields are {fields}." if hint else f"the fields are {fields}"
            raise ConfigError(expected(culprit, "a Config field", f"unknown {name!r}", fix, raw=True))


# -- one check per field: each raises ConfigError("field: expected X, got Y; do Z") -------


def _bool(name: str, value: Any) -> None:
    expect(isinstance(value, bool), name, "True or False", value,
           f"write {name}=True or {name}=False (strings and 0/1 are not accepted)", ConfigError)


def _optional_bool(name: str, value: Any) -> None:
    expect(value is None or isinstance(value, bool), name, "None, True or False", value,
           f"write {name}=None (automatic), True or False", ConfigError)


def _count(fix: str = "") -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        expect(ok, name, "a non-negative int", value, fix, ConfigError)

    return check


def _optional_text(fix: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        ok = value is None or (isinstance(value, (str, os.PathLike)) and os.fspath(value) != "")
        expect(ok, name, "None or a non-empty string", value, fix, ConfigError)

    return check


def _dump_dir(name: str, value: Any) -> None:
    _optional_text("write dump_dir='path/to/folder'")(name, value)
    if value is not None:
        check_dump_dir(name, value)


def _choice(*choices: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        fix = closest(value, choices) if isinstance(value, str) else ""
        expect(isinstance(value, str) and value in choices, name, f"one of {choices}", value, fix, ConfigError)

    return check


def _ops(name: str, value: Any) -> None:
    expect(isinstance(value, tuple), name, "a tuple or list of ops", value,
           f"write {name}=['ns::op'] even for one op", ConfigError)


def _capture_sizes(name: str, sizes: Any) -> None:
    # No upper bound: nothing is allocated per size until a call of that size runs (the
    # padding table is a binary search), and the largest sensible size depends on the model.
    expect(isinstance(sizes, tuple) and len(sizes) > 0, name, "a non-empty tuple or list of positive ints",
           sizes, "e.g. (1, 2, 4, 8)", ConfigError)
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
    expect(not bad, name, "positive ints", bad, "e.g. (1, 2, 4, 8)", ConfigError)
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


_FIELD_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "splitting_ops": _ops,
    "capture_sizes": _capture_sizes,
    "compiler": _choice(*COMPILERS),
    "cudagraphs": _optional_bool,
    "dump_dir": _dump_dir,
    "capture_input": _optional_text("name the input as in forward, e.g. capture_input='input_ids'"),
    "capture_input_dim": _count("e.g. 1 for input_ids' dimension 1"),
    "reuse_output_buffers": _bool,
    "check_addresses": _bool,
    "use_breakable": _bool,
    "capture_error_mode": _choice("global", "thread_local", "relaxed"),
    "cudnn_attention": _bool,
    "fold_grouped_query": _bool,
    "fuse_sibling_linears": _bool,
    "padding": _optional_bool,
    "exact_size_limit": _count("0 runs graphs that cannot be padded without CUDA graphs"),
    "compile_sizes": _compile_sizes,
    "inductor_options": _inductor_options,
    "size_inductor_options": _inductor_options,
    "capturable_split_ops": _ops,
    "full_graph_compile": _bool,
    "small_query_attention": _bool,
}
