"""Every wrong use of the public API ends in a CGCompileError that names the culprit.

One row per wrong use: what is called, the error class expected, and the text that
names the culprit (field, argument, environment variable). Every row also checks the
message's form ("expected X, got Y") and that nothing was compiled, captured or warmed
up by the failing call. The rows run on CPU; `cuda=True` rows make cgcompile's checks
believe a CUDA device is present (`aot_capture.cuda_present`, the one place they ask),
to reach the checks a CUDA machine reaches.
"""

from __future__ import annotations

import dataclasses
import re
import tracemalloc
from typing import Any, Callable

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile import ArgumentError, CaptureError, CGCompileError, Config, ConfigError, StateError
from cgcompile.tools import aot_capture
from cgcompile.config import FLAT_NAMES, MAX_CAPTURE_SIZE
from cgcompile.tools.inspect_dump import summaries
from cgcompile.testing.models import SILLY_OP, ToyLlama


class World:
    """What a row may use: a backend with a compiled model, a manager, a recording make_inputs."""

    def __init__(self):
        torch._dynamo.reset()
        self.model = ToyLlama(1)
        self.backend = cgcompile.Backend(Config(compiler="eager", splitting_ops=(SILLY_OP,), capture_sizes=(1, 2)))
        self.compiled = torch.compile(self.model, backend=self.backend)
        self.manager = cgcompile.GraphManager(self.model, Config(splitting_ops=(SILLY_OP,), capture_sizes=(1, 2)))
        self.calls: list[tuple[int, bool]] = []

    def make_inputs(self, size: int, warmup: bool):
        self.calls.append((size, warmup))
        return (torch.zeros(size, dtype=torch.long),)

    def make_wrong_shapes(self, size: int, warmup: bool):
        self.calls.append((size, warmup))
        return (torch.zeros(size, 3),)  # ToyLlama takes token ids [T], not floats [T, 3]

    def state(self) -> tuple:
        """Everything a failing call must leave as it was."""
        return (
            dataclasses.astuple(self.backend.stats), len(self.backend.pieces), len(self.backend.runtimes),
            self.manager.session.graphs_captured, self.manager._compiled, self.manager._breakable,
        )


@dataclasses.dataclass(frozen=True)
class Row:
    call: Callable[[World], Any]
    error: type[CGCompileError]
    culprit: str  # text the message must contain: the field or argument at fault
    hint: str = ""  # more text the message must contain (the suggestion or the fix)
    cuda: bool = False  # pretend a CUDA device is present
    env: str | None = None  # CGCOMPILE_USE_BREAKABLE for this row
    dump_env: str | None = None  # CGCOMPILE_DUMP_DIR for this row
    calls_make_inputs: bool = False  # the failure is in what make_inputs returned
    form: bool = True  # the message reads "expected X, got Y" (False: worded outside this change)


def compile_with(options: dict) -> Callable[[World], Any]:
    def call(w: World):
        torch.compile(w.model, backend="cgcompile", options=options)(torch.zeros(2, dtype=torch.long))

    return call


def capture_sequential(name: str) -> Callable[[World], Any]:
    def call(w: World):
        backend = cgcompile.Backend(Config(compiler="eager", capture_input=name))
        torch.compile(nn.Sequential(nn.Linear(4, 4)), backend=backend)(torch.randn(3, 4))

    return call


ROWS = {
    # Config: every field checked for its type, unknown names listed with the nearest
    "unknown field": Row(lambda w: Config(capture_size=(1, 2)), ConfigError, "'capture_size'",
                         "did you mean 'capture_sizes'? The fields are ["),
    "positional args": Row(lambda w: Config((), (1, 2)), ConfigError, "keyword arguments only"),
    "bool as string": Row(lambda w: Config(use_breakable="false"), ConfigError, "use_breakable", "got 'false'"),
    "reuse as string": Row(lambda w: Config(reuse_output_buffers="no"), ConfigError, "reuse_output_buffers"),
    "check_addresses None": Row(lambda w: Config(check_addresses=None), ConfigError, "check_addresses"),
    "cudnn as int": Row(lambda w: Config(cudnn_attention=1), ConfigError, "cudnn_attention", "got 1 (int)"),
    "fold as string": Row(lambda w: Config(fold_grouped_query="yes"), ConfigError, "fold_grouped_query"),
    "dump_dir int": Row(lambda w: Config(dump_dir=123), ConfigError, "dump_dir", "got 123 (int)"),
    "dump_dir empty": Row(lambda w: Config(dump_dir=""), ConfigError, "dump_dir"),
    "cudagraphs string": Row(lambda w: Config(cudagraphs="yes"), ConfigError, "cudagraphs"),
    "cudagraphs int": Row(lambda w: Config(cudagraphs=1), ConfigError, "cudagraphs"),
    "padding string": Row(lambda w: Config(padding="auto"), ConfigError, "padding"),
    "compiler unknown": Row(lambda w: Config(compiler="tvm"), ConfigError, "compiler", "('eager', 'inductor')"),
    "compiler misspelt": Row(lambda w: Config(compiler="inducter"), ConfigError, "compiler", "did you mean 'inductor'"),
    "error mode": Row(lambda w: Config(capture_error_mode="strict"), ConfigError, "capture_error_mode"),
    "sizes empty": Row(lambda w: Config(capture_sizes=()), ConfigError, "capture_sizes"),
    "sizes zero": Row(lambda w: Config(capture_sizes=(0, 1)), ConfigError, "capture_sizes", "got [0]"),
    "sizes float": Row(lambda w: Config(capture_sizes=(1, 2.5)), ConfigError, "capture_sizes", "got [2.5]"),
    "sizes bool": Row(lambda w: Config(capture_sizes=(True, 2)), ConfigError, "capture_sizes", "got [True]"),
    "sizes repeated": Row(lambda w: Config(capture_sizes=[2, 2]), ConfigError, "capture_sizes", "[2] more than once"),
    "sizes huge": Row(lambda w: Config(capture_sizes=(10**9,), padding=True), ConfigError, "capture_sizes",
                      "at most 65536, got [1000000000]"),
    "compile sizes huge": Row(lambda w: Config(compile_sizes=(70000,)), ConfigError, "compile_sizes", "at most 65536"),
    "sizes string": Row(lambda w: Config(capture_sizes="1,2"), ConfigError, "capture_sizes"),
    "sizes int": Row(lambda w: Config(capture_sizes=8), ConfigError, "capture_sizes", "got 8 (int)"),
    "ops string": Row(lambda w: Config(splitting_ops=SILLY_OP), ConfigError, "splitting_ops", "even for one op"),
    "ops int": Row(lambda w: Config(splitting_ops=[42]), ConfigError, "splitting_ops", "got 42"),
    "ops unknown": Row(lambda w: Config(splitting_ops=["mylib::no_such_op"]), ConfigError, "splitting_ops",
                       "got 'mylib::no_such_op', which is not registered"),
    "ops unqualified": Row(lambda w: Config(splitting_ops=["attention"]), ConfigError, "splitting_ops", "'ns::op'"),
    "input dim negative": Row(lambda w: Config(capture_input_dim=-1), ConfigError, "capture_input_dim"),
    "input dim bool": Row(lambda w: Config(capture_input_dim=True), ConfigError, "capture_input_dim"),
    "input int": Row(lambda w: Config(capture_input=0), ConfigError, "capture_input"),
    "size limit negative": Row(lambda w: Config(exact_size_limit=-1), ConfigError, "exact_size_limit"),
    # options that mean something only together: a full-graph option needs capturable ops
    "whole compile without full graph": Row(lambda w: Config(full_graph_compile=True), ConfigError,
                                            "full_graph_compile", 'add capturable_split_ops=("attention",)'),
    "small query without full graph": Row(lambda w: Config(compiler="eager", small_query_attention=True), ConfigError,
                                          "small_query_attention", "without capturable_split_ops"),
    "group misspelt field": Row(lambda w: Config(sizes={"capture_size": (1, 2)}), ConfigError, "'capture_size'",
                                "did you mean 'capture_sizes'?"),
    "group of the wrong type": Row(lambda w: Config(full_graph="attention"), ConfigError, "full_graph",
                                   "a FullGraphOptions, None, 'auto' or a dict of its fields"),
    # torch.compile(..., options=...): the same checks (Dynamo wraps them; the rows unwrap)
    "options unknown": Row(compile_with({"compiler": "eager", "bogus": 1}), ConfigError, "'bogus'", "the fields are"),
    "options bool as string": Row(compile_with({"use_breakable": "false"}), ConfigError, "use_breakable"),
    "options not a dict": Row(lambda w: Config.from_options(["compiler"]), ConfigError, "options", "a dict"),
    "options whole compile alone": Row(compile_with({"compiler": "eager", "full_graph_compile": True}), ConfigError,
                                       "full_graph_compile", "without capturable_split_ops"),
    # the environment variable, refused on every path
    "env manager": Row(lambda w: cgcompile.GraphManager(w.model), ConfigError, "CGCOMPILE_USE_BREAKABLE",
                       "got 'maybe'", env="maybe"),
    "env backend": Row(lambda w: cgcompile.Backend(), ConfigError, "CGCOMPILE_USE_BREAKABLE", env="maybe"),
    "env compiled path": Row(compile_with({"compiler": "eager"}), ConfigError, "CGCOMPILE_USE_BREAKABLE", env="maybe"),
    # Backend
    "backend dict": Row(lambda w: cgcompile.Backend({"compiler": "eager"}), ConfigError, "Backend: config",
                        "Config.from_options"),
    "backend string": Row(lambda w: cgcompile.Backend("eager"), ConfigError, "Backend: config"),
    "backend pool": Row(lambda w: cgcompile.Backend(pool="mine"), ArgumentError, "Backend: pool"),
    "capture on cpu": Row(lambda w: w.backend.capture(w.compiled, w.make_inputs), CaptureError, "Backend.capture",
                          "CUDA graphs need CUDA"),
    "capture graphs off": Row(
        lambda w: cgcompile.Backend(Config(cudagraphs=False)).capture(w.compiled, w.make_inputs), CaptureError,
        "Backend.capture", "got Config.cudagraphs=False", cuda=True),
    "capture size too large": Row(lambda w: w.backend.capture(w.compiled, w.make_inputs, sizes=(64,)), ArgumentError,
                                  "Backend.capture: sizes", "largest capture size 2, got [64]"),
    "capture sizes string": Row(lambda w: w.backend.capture(w.compiled, w.make_inputs, sizes="all"), ArgumentError,
                                "Backend.capture: sizes"),
    "capture no factory": Row(lambda w: w.backend.capture(w.compiled, None), ArgumentError, "make_inputs"),
    "capture inputs for a factory": Row(lambda w: w.backend.capture(w.compiled, (torch.zeros(2),)), ArgumentError,
                                        "make_inputs", "lambda size, warmup"),
    "capture of an uncallable": Row(lambda w: w.backend.capture("model", w.make_inputs), ArgumentError,
                                    "Backend.capture: model"),
    "capture progress": Row(lambda w: w.backend.capture(w.compiled, w.make_inputs, progress="no"), ArgumentError,
                            "progress"),
    "capture wrong shapes": Row(lambda w: w.backend.capture(w.compiled, w.make_wrong_shapes), CaptureError,
                                "capture of size 2 (warm-up run)", "got RuntimeError: ", cuda=True,
                                calls_make_inputs=True),
    "capture inputs as list": Row(lambda w: w.backend.capture(w.compiled, lambda s, warm: [torch.zeros(s)]),
                                  ArgumentError, "make_inputs(2, True)", "write tuple(inputs)", cuda=True),
    "profile on cpu": Row(lambda w: w.backend.profile_capture_memory(w.compiled, w.make_inputs), CaptureError,
                          "profile_capture_memory", "CUDA graphs need CUDA"),
    "profile sizes zero": Row(lambda w: w.backend.profile_capture_memory(w.compiled, w.make_inputs, sizes=(0,)),
                              ArgumentError, "profile_capture_memory: sizes", "got [0]"),
    "capture budget zero": Row(lambda w: w.backend.capture(w.compiled, w.make_inputs, memory_budget=0), ArgumentError,
                               "Backend.capture: memory_budget", "got 0 (int)"),
    "capture budget float": Row(lambda w: w.backend.capture(w.compiled, w.make_inputs, memory_budget=2e9),
                                ArgumentError, "Backend.capture: memory_budget", "int(...)"),
    "plan budget on cpu": Row(lambda w: w.backend.plan_memory(w.compiled, w.make_inputs, memory_budget=1 << 30),
                              CaptureError, "plan_memory", "on CPU call plan_memory() with no arguments"),
    "backend_of an eager model": Row(lambda w: cgcompile.backend_of(w.model), ArgumentError, "backend_of",
                                     "called at least once"),
    "capture_input unknown": Row(capture_sequential("x"), ConfigError, "capture_input", "input (L['args'][0])"),
    # GraphManager
    "manager function": Row(lambda w: cgcompile.GraphManager(lambda t: t), ArgumentError, "GraphManager: model",
                            "torch.compile(fn, backend=cgcompile.Backend())"),
    "manager None": Row(lambda w: cgcompile.GraphManager(None), ArgumentError, "GraphManager: model", "got None"),
    "manager dict config": Row(lambda w: cgcompile.GraphManager(w.model, {"use_breakable": True}), ConfigError,
                               "GraphManager: config"),
    "manager boundary path": Row(lambda w: cgcompile.GraphManager(w.model, boundary="decoder"), ConfigError,
                                 "boundary", "got 'decoder', which names none"),
    "manager boundary int": Row(lambda w: cgcompile.GraphManager(w.model, boundary=5), ConfigError, "boundary"),
    "manager pool": Row(lambda w: cgcompile.GraphManager(w.model, pool=[1, 2]), ArgumentError, "GraphManager: pool"),
    "manager graphs without cuda": Row(lambda w: cgcompile.GraphManager(w.model, Config(cudagraphs=True)), ConfigError,
                                       "cudagraphs", "without CUDA"),
    "run list": Row(lambda w: w.manager.run_pw_graph(w.model, [torch.zeros(2, dtype=torch.long)]), ArgumentError,
                    "run_pw_graph: inputs", "write tuple(inputs)"),
    "run another model": Row(lambda w: w.manager.run_pw_graph(ToyLlama(1), (torch.zeros(2, dtype=torch.long),)),
                             ArgumentError, "run_pw_graph", "one GraphManager per model"),
    "manager capture too large": Row(lambda w: w.manager.capture(w.make_inputs, sizes=(64,)), ArgumentError,
                                     "GraphManager.capture: sizes", "largest capture size 2, got [64]"),
    "manager capture on cpu": Row(lambda w: w.manager.capture(w.make_inputs), CaptureError, "GraphManager.capture",
                                  "CUDA graphs need CUDA"),
    "manager capture model on cpu": Row(lambda w: w.manager.capture(w.make_inputs), CaptureError,
                                        "GraphManager.capture", "ToyLlama with no parameter on CUDA", cuda=True),
    "manager capture factory": Row(lambda w: w.manager.capture(5), ArgumentError, "make_inputs"),
    # eager_break and inspection
    "eager_break int": Row(lambda w: cgcompile.eager_break(5), ArgumentError, "eager_break", "got 5 (int)"),
    "eager_break called": Row(lambda w: cgcompile.eager_break(), ArgumentError, "eager_break", "without parentheses"),
    "inspect missing folder": Row(lambda w: summaries("/no/such/folder"), ArgumentError, "dump_dir"),
    # what a newcomer hits
    "backend class": Row(lambda w: torch.compile(w.model, backend=cgcompile.Backend)(torch.zeros(2, dtype=torch.long)),
                         ArgumentError, "torch.compile: backend", "write backend=cgcompile.Backend()"),
    "torch.compile mode": Row(lambda w: torch.compile(w.model, backend="cgcompile", mode="reduce-overhead")(
        torch.zeros(2, dtype=torch.long)), ConfigError, 'backend="cgcompile"): mode', "leave mode out"),
    "torch.compile mode, Backend": Row(lambda w: torch.compile(w.model, backend=cgcompile.Backend(), mode="max-autotune")(
        torch.zeros(2, dtype=torch.long)), ConfigError, "backend=Backend(...)): mode", "Backend(Config(...))"),
    "op_replay on the compiled path": Row(lambda w: cgcompile.GraphManager(w.model, segments="op_replay"),
                                          ArgumentError, "GraphManager: segments", "set Config(use_breakable=True)"),
    "op_replay with the env's compiled path": Row(
        lambda w: cgcompile.GraphManager(w.model, Config(use_breakable=True), segments="op_replay"), ArgumentError,
        "GraphManager: segments", "unset CGCOMPILE_USE_BREAKABLE=0 (it overrides Config(use_breakable=...))", env="0"),
    "capturable sdpa": Row(lambda w: Config(capturable_split_ops=("sdpa",)), ConfigError, "capturable_split_ops",
                           '"attention"'),
    "inductor value type": Row(lambda w: Config(inductor_options={"max_autotune": "yes"}), ConfigError,
                               "inductor_options['max_autotune']", "type bool"),
    "inductor nested dict": Row(lambda w: Config(inductor_options={"triton": {"max_tiles": 2}}), ConfigError,
                                "inductor_options", "{'triton.max_tiles': 2}"),
    "dump_dir under a file": Row(lambda w: Config(dump_dir=__file__ + "/dump"), ConfigError, "dump_dir",
                                "under the file"),
    "dump_dir in /proc": Row(lambda w: Config(dump_dir="/proc/cgcompile_dump"), ConfigError, "dump_dir",
                             "can create and write"),
    "dump_dir env in /proc": Row(lambda w: cgcompile.Backend(), ConfigError, "CGCOMPILE_DUMP_DIR", "/proc",
                                 dump_env="/proc/cgcompile_dump"),
    "plan before a call": Row(lambda w: cgcompile.Backend().plan_memory(), StateError, "Backend.plan_memory",
                              "call the compiled model once"),
    "backend_of a model whose forward was compiled": Row(
        lambda w: cgcompile.backend_of(_forward_compiled(w.model)), ArgumentError, "backend_of",
        "Dynamo compiles at the first call"),
    "two managers installed": Row(lambda w: [cgcompile.GraphManager(w.model, Config(cudagraphs=True)).install()
                                             for _ in range(2)], StateError, "GraphManager.install",
                                  "another manager installed on", cuda=True),
    "uninstall before install": Row(lambda w: w.manager.uninstall(), StateError, "GraphManager.uninstall",
                                    "call install() first"),
}


def _forward_compiled(model: nn.Module) -> nn.Module:
    model.forward = torch.compile(model.forward, backend="cgcompile", options={"compiler": "eager"})
    return model


def _raised(row: Row, world: World) -> BaseException:
    try:
        row.call(world)
    except torch._dynamo.exc.BackendCompilerFailed as e:  # Dynamo wraps what a backend raises
        return e.inner_exception
    except BaseException as e:  # noqa: BLE001 - the row decides what is right
        return e
    pytest.fail("no error raised")


@pytest.mark.parametrize("name", ROWS)
def test_bad_input(name, monkeypatch):
    row = ROWS[name]
    monkeypatch.delenv("CGCOMPILE_USE_BREAKABLE", raising=False)
    monkeypatch.delenv("CGCOMPILE_DUMP_DIR", raising=False)
    world = World()
    before = world.state()
    if row.env is not None:
        monkeypatch.setenv("CGCOMPILE_USE_BREAKABLE", row.env)
    if row.dump_env is not None:
        monkeypatch.setenv("CGCOMPILE_DUMP_DIR", row.dump_env)
    if row.cuda:
        monkeypatch.setattr(aot_capture, "cuda_present", lambda: True)

    error = _raised(row, world)

    assert type(error) is row.error, f"{type(error).__name__}: {error}"
    message = str(error)
    assert row.culprit in message, message
    assert row.hint in message, message
    assert re.search(r"expected .+, got ", message) or not row.form, message
    assert world.state() == before, "the failing call changed the backend or the manager"
    assert bool(world.calls) == row.calls_make_inputs, f"make_inputs ran: {world.calls}"


def test_at_least_the_issues_28_wrong_uses():
    assert len(ROWS) >= 28


def test_every_config_field_is_type_checked():
    for name in [*FLAT_NAMES, *(part.name for part in dataclasses.fields(Config))]:  # flat names and groups
        with pytest.raises(ConfigError, match=f"^{name}: expected (?!capturable_split_ops beside)"):
            Config(**{name: object()})


def test_wrong_shapes_error_is_chained_to_the_cause(monkeypatch):
    monkeypatch.setattr(aot_capture, "cuda_present", lambda: True)
    world = World()
    error = _raised(ROWS["capture wrong shapes"], world)
    assert isinstance(error.__cause__, torch._dynamo.exc.TorchRuntimeError)
    assert world.calls == [(2, True)]  # the first run of the largest size, and nothing after it


def test_no_progress_bar_before_the_cuda_error(capsys):
    world = World()
    with pytest.raises(CaptureError):
        world.backend.capture(world.compiled, world.make_inputs)
    assert "cgcompile capture" not in capsys.readouterr().err


def test_lists_are_accepted_for_tuple_fields_both_ways():
    config = Config(capture_sizes=[1, 2, 4], splitting_ops=[SILLY_OP])
    assert config == Config(capture_sizes=(1, 2, 4), splitting_ops=(SILLY_OP,))
    assert config == Config.from_options({"capture_sizes": [1, 2, 4], "splitting_ops": [SILLY_OP]})
    assert isinstance(config.sizes.capture_sizes, tuple) and hash(config) == hash(Config(**dataclasses.asdict(config)))


def test_the_largest_capture_size_costs_no_memory():
    largest = MAX_CAPTURE_SIZE  # nothing is allocated per size until a call of that size runs
    tracemalloc.start()
    try:
        backend = cgcompile.Backend(Config(capture_sizes=(1, largest)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"building the backend took {peak} bytes"
    assert backend.session.padding.padded(2) == largest


def test_what_a_newcomer_writes_is_taken_as_meant():
    import numpy as np

    @torch.library.custom_op("cgcompile_bad_inputs::op", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    config = Config(splitting_ops=[op], capturable_split_ops=[op], capture_sizes=(np.int64(8), 4, np.int32(2), 1))
    assert config.split_ops.extra == {"cgcompile_bad_inputs::op.default"}  # the custom_op object the user holds
    assert config.full_graph.capturable_ops.names == {"cgcompile_bad_inputs::op.default"}
    assert config.sizes.capture_sizes == (1, 2, 4, 8) and all(type(s) is int for s in config.sizes.capture_sizes)


def test_backend_of_a_model_whose_forward_was_compiled():
    torch._dynamo.reset()
    model = _forward_compiled(ToyLlama(1))
    model(torch.zeros(2, dtype=torch.long))
    assert cgcompile.backend_of(model) is cgcompile.backend_of(model.forward)


def test_run_pw_graph_takes_a_tuple_a_dict_or_one_tensor():
    model = ToyLlama(1)
    manager = cgcompile.GraphManager(model)
    ids = torch.randint(0, 64, (3,))
    expected = model(ids)
    for inputs in ((ids,), {"ids": ids}, ids):
        assert torch.equal(manager.run_pw_graph(model, inputs), expected)


@pytest.mark.cuda
def test_capture_of_wrong_shapes_on_cuda_names_the_size():
    torch._dynamo.reset()
    model = ToyLlama(1).cuda()
    backend = cgcompile.Backend(Config(compiler="eager", splitting_ops=(SILLY_OP,), capture_sizes=(1, 2)))
    compiled = torch.compile(model, backend=backend)
    with pytest.raises(CaptureError, match=r"capture of size 2 \(warm-up run\)") as info:
        backend.capture(compiled, lambda size, warmup: (torch.zeros(size, 3, device="cuda"),), progress=False)
    assert info.value.__cause__ is not None
    assert backend.stats.graphs_captured == 0
