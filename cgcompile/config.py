"""The one frozen configuration object, validated when it is built."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from .errors import ConfigError
from .split_ops import SplitOps, normalize_op

DEFAULT_CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 257, 8))
COMPILERS = ("eager", "inductor")
DUMP_DIR_ENV = "CGCOMPILE_DUMP_DIR"
USE_BREAKABLE_ENV = "CGCOMPILE_USE_BREAKABLE"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """How cgcompile splits, compiles and captures a model.

    splitting_ops: ops to split at besides the defaults (attention in every form,
        flash-attn ops, ops tagged `cudagraph_unsafe`): op objects or "ns::op[.overload]".
    capture_sizes: sizes of the capture dimension that get a CUDA graph; a call of size n
        runs padded to the smallest capture size >= n.
    compiler: "eager" runs capturable pieces as FX code; "inductor" compiles each once.
    cudagraphs: None = on when the graph's tensors are on CUDA.
    dump_dir: write graphs and a split summary here (or set CGCOMPILE_DUMP_DIR).
    capture_input / capture_input_dim: override which graph input's dimension is the
        capture dimension (see `cgcompile.passes.find_capture_dim` for the default rule).
        The input is named as in the model's forward, e.g. "input_ids".
    reuse_output_buffers: return the graphs' static output buffers instead of copies.
        Faster, but a later call overwrites outputs the caller still holds.
    check_addresses: on every replay, check that inputs captured by address still live
        there, and raise naming the piece and input if not (debugging aid).
    cudnn_attention: let scaled_dot_product_attention in the eager pieces use its cuDNN
        backend. Off by default: cuDNN builds a plan for every new key length (tens of
        ms each, then a host-side lookup per call), and split attention sees a new
        length at every decode step. See `cgcompile.attention_backend`.
    fold_grouped_query: where a one-token query meets KV heads repeated for grouped-query
        attention (`repeat_kv`), let SDPA read the un-repeated cache instead (see
        `cgcompile.passes.grouped_query`): two copies of the cache per layer and step
        fewer. Results agree with eager to rounding, not bit for bit; False keeps the
        model's own attention calls.
    capture_error_mode: torch's check for unsafe CUDA calls during capture: "global",
        "thread_local" (other threads, e.g. NCCL proxies, may use CUDA meanwhile) or "relaxed".
    use_breakable: the manager's default path (breakable CUDA graphs instead of compiled
        pieces); the CGCOMPILE_USE_BREAKABLE environment variable overrides it.
    padding: None pads calls to the capture sizes when CUDA graphs are on; True pads
        them even without graphs (on CPU too: how the tests exercise padding); False never
        pads (every graph is captured at the exact sizes seen). A Dynamo graph whose
        capturable code mixes rows along the capture dimension is never padded, whatever
        this says (see `cgcompile.passes.padding_safety`).
    exact_size_limit: a graph that runs at exact sizes (padding off, or unsafe to pad)
        captures one set of CUDA graphs per distinct size, for at most this many sizes;
        calls of further new sizes run its pieces without graphs (logged once).
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
    padding: bool | None = None
    exact_size_limit: int = 32

    def __post_init__(self):
        _check_capture_sizes(self.capture_sizes)
        if self.compiler not in COMPILERS:
            raise ConfigError(f"compiler: expected one of {COMPILERS}, got {self.compiler!r}")
        if self.cudagraphs not in (None, True, False):
            raise ConfigError(f"cudagraphs: expected None, True or False, got {self.cudagraphs!r}")
        if self.capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ConfigError(
                f"capture_error_mode: expected 'global', 'thread_local' or 'relaxed', got {self.capture_error_mode!r}"
            )
        if self.padding not in (None, True, False) or isinstance(self.padding, int) and not isinstance(self.padding, bool):
            raise ConfigError(f"padding: expected None, True or False, got {self.padding!r}")
        if not isinstance(self.exact_size_limit, int) or isinstance(self.exact_size_limit, bool) or self.exact_size_limit < 0:
            raise ConfigError(
                f"exact_size_limit: expected a non-negative int, got {self.exact_size_limit!r}; "
                f"0 runs graphs that cannot be padded without CUDA graphs"
            )
        if not isinstance(self.capture_input_dim, int) or self.capture_input_dim < 0:
            raise ConfigError(
                f"capture_input_dim: expected a non-negative int, got {self.capture_input_dim!r}"
            )
        self.split_ops  # validates every splitting op name now, not at the first compile

    @functools.cached_property
    def split_ops(self) -> SplitOps:
        if isinstance(self.splitting_ops, (str, bytes)) or not hasattr(self.splitting_ops, "__iter__"):
            raise ConfigError(
                f"splitting_ops: expected a list of ops, got {self.splitting_ops!r}; "
                f"write splitting_ops=['ns::op'] even for one op"
            )
        return SplitOps(frozenset(normalize_op(op) for op in self.splitting_ops))

    @property
    def max_capture_size(self) -> int:
        return max(self.capture_sizes)

    def pads(self, cudagraphs: bool) -> bool:
        """Whether calls are padded to the capture sizes, for a graph with graphs on or off."""
        return cudagraphs if self.padding is None else self.padding

    def resolved_dump_dir(self) -> str | None:
        """`dump_dir`, or the CGCOMPILE_DUMP_DIR environment variable (read here only)."""
        return self.dump_dir or os.environ.get(DUMP_DIR_ENV) or None

    def resolved_use_breakable(self) -> bool:
        """`use_breakable`, unless CGCOMPILE_USE_BREAKABLE=0/1 overrides it (read here only)."""
        value = os.environ.get(USE_BREAKABLE_ENV)
        if value is None or value == "":
            return self.use_breakable
        if value not in ("0", "1"):
            raise ConfigError(f"{USE_BREAKABLE_ENV}: expected 0 or 1, got {value!r}")
        return value == "1"

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> "Config":
        """Build from `torch.compile(..., options={...})`; unknown keys are an error."""
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown cgcompile option(s) {unknown}; valid options are {sorted(known)}"
            )
        if "capture_sizes" in options:
            options["capture_sizes"] = tuple(options["capture_sizes"])
        if "splitting_ops" in options and isinstance(options["splitting_ops"], list):
            options["splitting_ops"] = tuple(options["splitting_ops"])
        return cls(**options)


def _check_capture_sizes(sizes) -> None:
    if not isinstance(sizes, tuple) or not sizes:
        raise ConfigError(
            f"capture_sizes: expected a non-empty tuple of positive ints, got {sizes!r}"
        )
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
    if bad:
        raise ConfigError(f"capture_sizes: expected positive ints, got {bad}; e.g. (1, 2, 4, 8)")
    dupes = sorted({s for s in sizes if sizes.count(s) > 1})
    if dupes:
        raise ConfigError(f"capture_sizes: duplicate sizes {dupes}; list each size once")
