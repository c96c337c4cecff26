"""Config: defaults, validation at construction, and the split-op predicate it builds."""

import dataclasses
import importlib.util
import inspect
import pathlib

import pytest
import torch

import cgcompile
from cgcompile import Config, ConfigError
from cgcompile.config import AUTO, FLAT_NAMES, MAX_CAPTURE_SIZE, Compile, FullGraphOptions, Sizes, automatic_full_graph
from cgcompile.testing.models import SILLY_OP


def test_defaults():
    config = Config()
    assert config.sizes.capture_sizes == (1, 2, 4) + tuple(range(8, 257, 8))
    assert config.max_capture_size == 256
    assert config.compile.compiler == "inductor"
    assert config.graphs.cudagraphs is None
    assert config.debug.dump_dir is None
    assert config.split.splitting_ops == ()


def test_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().compile = Compile(compiler="eager")
    with pytest.raises(ConfigError, match=r"Config: expected keyword arguments only, got 2 positional"):
        Config((), (1, 2))


def test_config_errors_are_cgcompile_errors():
    assert issubclass(ConfigError, cgcompile.CGCompileError)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "op",
    [SILLY_OP, SILLY_OP + ".default", torch.ops.cgcompile_testing.silly_attention,
     torch.ops.cgcompile_testing.silly_attention.default],
)
def test_splitting_op_forms(op):
    reason = Config(splitting_ops=[op]).split_ops.reason(torch.ops.cgcompile_testing.silly_attention.default)
    assert reason == f"{SILLY_OP}.default is listed in Config.splitting_ops"


def test_default_split_set():
    ops = Config().split_ops
    assert "attention" in ops.reason(torch.nn.functional.scaled_dot_product_attention)
    assert "attention" in ops.reason(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert "attention" in ops.reason(torch.ops.aten.scaled_dot_product_attention.default)
    assert ops.reason(torch.ops.aten.mm.default) is None
    assert ops.reason(torch.ops.cgcompile_testing.silly_attention.default) is None
    assert ops.reason(torch.sin) is None


def test_unknown_op_name():
    with pytest.raises(ConfigError, match=r"got 'mylib::no_such_op', which is not registered; check the spelling"):
        Config(splitting_ops=["mylib::no_such_op"])
    with pytest.raises(ConfigError, match=r"got 'aten::mm.no_such_overload', which is not registered"):
        Config(splitting_ops=["aten::mm.no_such_overload"])


def test_unqualified_op_name():
    with pytest.raises(ConfigError, match=r"expected a qualified name 'ns::op'.*got 'silly_attention'; write for example"):
        Config(splitting_ops=["silly_attention"])


def test_op_of_wrong_type():
    with pytest.raises(ConfigError, match=r"expected an op such as torch.ops.aten.mm.*got 42 of type int"):
        Config(splitting_ops=[42])


def test_one_op_as_a_bare_string():
    with pytest.raises(ConfigError, match=r"write splitting_ops=\['ns::op'\] even for one op"):
        Config(splitting_ops=SILLY_OP)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ((0, 1), r"capture_sizes: expected positive ints, got \[0\]"),
        ((4, -8), r"capture_sizes: expected positive ints, got \[-8\]"),
        ((1, 2.5), r"capture_sizes: expected positive ints, got \[2.5\]"),
        ((1, 2, 2, 4, 4), r"capture_sizes: expected each size once, got \[2, 4\] more than once; remove the repeats"),
        ((), r"capture_sizes: expected a non-empty tuple or list of positive ints, got \(\)"),
        ((8, 10**9), r"capture_sizes: expected sizes of at most 65536, got \[1000000000\] \(list\); use the batch or"),
    ],
)
def test_bad_capture_sizes(sizes, message):
    with pytest.raises(ConfigError, match=message):
        Config(capture_sizes=sizes)


def test_unknown_compiler():
    with pytest.raises(ConfigError, match=r"compiler: expected one of \('eager', 'inductor'\), got 'tvm'"):
        Config(compiler="tvm")


def test_from_options():
    config = Config.from_options({"compiler": "eager", "capture_sizes": [1, 2], "splitting_ops": [SILLY_OP]})
    assert config == Config(compiler="eager", capture_sizes=(1, 2), splitting_ops=(SILLY_OP,))
    assert Config.from_options(None) == Config()


def test_from_options_unknown_key():
    with pytest.raises(ConfigError, match=r"options: expected a Config field, got unknown 'bogus'; the fields are \[.*'compiler'"):
        Config.from_options({"bogus": 1})


def test_unknown_option_through_torch_compile():
    compiled = torch.compile(torch.sin, backend="cgcompile", options={"compiler": "eager", "bogus": 1})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.ones(3))
    assert isinstance(info.value.inner_exception, ConfigError)
    assert "options: expected a Config field, got unknown 'bogus'" in str(info.value)


def test_installed_torch_is_in_the_declared_range():
    import pathlib

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    Requirement = pytest.importorskip("packaging.requirements").Requirement
    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    (torch_requirement,) = [Requirement(d) for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    version = torch.__version__.split("+")[0]
    assert torch_requirement.specifier.contains(version, prereleases=True), (version, str(torch_requirement))


def test_each_backend_dumps_into_a_folder_of_its_own(tmp_path):
    from cgcompile.testing.models import ToyLlama

    for _ in range(2):
        backend = cgcompile.Backend(Config(compiler="eager", splitting_ops=[SILLY_OP], dump_dir=str(tmp_path)))
        torch.compile(ToyLlama(1), backend=backend)(torch.zeros(3, dtype=torch.long))
    assert (tmp_path / "graph_0" / "summary.json").exists()  # the first Backend: DUMP_DIR itself
    assert (tmp_path / "run_1" / "graph_0" / "summary.json").exists()  # the second: its own run folder
    assert not (tmp_path / "graph_1").exists()


def test_dump_dir_expands_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Config(dump_dir="~/dump").resolved_dump_dir() == str(tmp_path / "dump")


# -- groups: one record per concern, flat names derived from them ------------------------

FULL = ("attention",)


def test_flat_names_and_groups_build_the_same_config():
    flat = Config(capture_sizes=(1, 2), compiler="eager", capturable_split_ops=FULL, full_graph_compile=True)
    grouped = Config(sizes=Sizes(capture_sizes=(1, 2)), compile=Compile(compiler="eager"),
                     full_graph=FullGraphOptions(capturable_split_ops=FULL, full_graph_compile=True))
    as_dicts = Config.from_options({"sizes": {"capture_sizes": [1, 2]}, "compile": {"compiler": "eager"},
                                    "full_graph": {"full_graph_compile": True}})
    assert flat == grouped == as_dicts and hash(flat) == hash(grouped)
    assert flat.full_graph == FullGraphOptions(capturable_split_ops=FULL, full_graph_compile=True,
                                               small_query_attention=False)


def test_a_flat_read_names_the_group_read():
    config = Config(capture_sizes=(1, 2), full_graph=FullGraphOptions(full_graph_compile=True))
    for name in FLAT_NAMES:
        assert not hasattr(config, name), name  # flat names are for writing a Config only
    with pytest.raises(AttributeError, match=r"^config.capture_sizes: expected a read through its group, got the "
                                             r"flat name; read config.sizes.capture_sizes;"):
        config.capture_sizes
    with pytest.raises(AttributeError, match=r"read config.full_graph_for\(cudagraphs=True\).full_graph_compile"):
        config.full_graph_compile
    with pytest.raises(AttributeError, match=r"^'Config' object has no attribute 'bogus'$"):
        config.bogus
    assert (config.sizes.capture_sizes, config.full_graph.full_graph_compile) == ((1, 2), True)


def test_the_flat_names_are_the_group_field_names():
    declared = [(part.name, f.name) for part in dataclasses.fields(Config)
                for f in dataclasses.fields(part.metadata["group"])]
    assert sorted(FLAT_NAMES.values()) == sorted(declared)  # each group field has one flat name, none twice
    assert all(name == field for name, (_, field) in FLAT_NAMES.items())  # one name per field
    assert len(FLAT_NAMES) == len(declared)
    assert not set(FLAT_NAMES) & {part.name for part in dataclasses.fields(Config)}  # no name is group and field
    assert FLAT_NAMES["capturable_split_ops"] == ("full_graph", "capturable_split_ops")
    assert FLAT_NAMES["full_graph_compile"] == ("full_graph", "full_graph_compile")
    assert FLAT_NAMES["capture_sizes"] == ("sizes", "capture_sizes")
    assert set(inspect.signature(Config).parameters) == set(FLAT_NAMES) | {p.name for p in dataclasses.fields(Config)}


def test_flat_names_beside_their_group_are_applied_on_top():
    config = Config(sizes=Sizes(capture_sizes=(4,), padding=True), capture_sizes=(1, 2))
    assert config.sizes == Sizes(capture_sizes=(1, 2), padding=True)
    assert dataclasses.replace(config, compiler="eager").compile.compiler == "eager"
    whole = Config(full_graph=FullGraphOptions(full_graph_compile=True))
    assert dataclasses.replace(whole, full_graph_compile=False).full_graph == FullGraphOptions()
    assert dataclasses.replace(whole, full_graph=None).full_graph is None
    with pytest.raises(ConfigError, match=r"^full_graph_compile: expected capturable_split_ops beside it"):
        dataclasses.replace(whole, capturable_split_ops=())  # would leave compile=True with nothing to apply to


@pytest.mark.parametrize("flat, culprit, got", [
    ({"full_graph_compile": True}, "full_graph_compile", "full_graph_compile=True"),
    ({"small_query_attention": True}, "small_query_attention", "small_query_attention=True"),
    ({"full_graph_compile": True, "small_query_attention": True, "capturable_split_ops": []},
     "full_graph_compile, small_query_attention", "full_graph_compile=True, small_query_attention=True"),
])
def test_a_full_graph_option_without_capturable_split_ops_is_refused(flat, culprit, got):
    message = (f"^{culprit}: expected capturable_split_ops beside it .*, got {got} without capturable_split_ops; "
               r'add capturable_split_ops=\("attention",\), or leave ')
    with pytest.raises(ConfigError, match=message):
        Config(**flat)
    with pytest.raises(ConfigError, match=message):
        Config.from_options(flat)


TUNING = {"coordinate_descent_tuning": True}


@pytest.mark.parametrize("fields, message", [
    ({"size_inductor_options": TUNING},
     "^size_inductor_options: expected compile_sizes beside it .*got size_inductor_options without compile_sizes; "
     "add compile_sizes"),
    ({"compiler": "eager", "inductor_options": TUNING},
     "^inductor_options: expected an Inductor compile to patch .*got compiler='eager' and no full-graph compile; "
     'set compiler="inductor"'),
    ({"compiler": "eager", "inductor_options": TUNING, "capturable_split_ops": ("attention",)},
     "^inductor_options: expected an Inductor compile to patch"),
])
def test_compile_options_with_no_compile_to_patch_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        Config(**fields)


@pytest.mark.parametrize("fields", [
    {"compile_sizes": (8,), "size_inductor_options": TUNING},
    {"compiler": "inductor", "inductor_options": TUNING},
    {"compiler": "eager", "inductor_options": TUNING, "capturable_split_ops": ("attention",), "full_graph_compile": True},
    {"compiler": "eager", "inductor_options": TUNING, "capturable_split_ops": ("attention",),
     "full_graph_compile": True, "small_query_attention": True},
])
def test_compile_options_beside_a_compile_they_patch_are_kept(fields):
    config = Config(**fields)
    assert dict(config.compile.inductor_options) == fields.get("inductor_options", {})
    assert dict(config.compile.size_inductor_options) == fields.get("size_inductor_options", {})


@pytest.mark.parametrize("fields, patches", [
    ({}, {"combo_kernels": True, "triton.enable_pdl": True}),
    ({"combo_kernels": False}, {"combo_kernels": False, "triton.enable_pdl": True}),
    ({"dependent_launch": False}, {"combo_kernels": True, "triton.enable_pdl": False}),
    ({"inductor_options": TUNING}, {"combo_kernels": True, "triton.enable_pdl": True, **TUNING}),
    ({"inductor_options": {"combo_kernels": False}}, {"combo_kernels": False, "triton.enable_pdl": True}),  # the explicit option wins
    ({"inductor_options": {"triton.enable_pdl": False}}, {"combo_kernels": True, "triton.enable_pdl": False}),
])
def test_every_compile_is_patched_with_combo_kernels_and_dependent_launch_unless_asked_otherwise(fields, patches):
    assert Config(**fields).compile.inductor_patches() == patches


def test_full_graph_options_at_their_defaults_need_no_capturable_ops():
    assert Config(full_graph_compile=False, small_query_attention=False, capturable_split_ops=()).full_graph is None
    assert Config(full_graph=None) == Config(capturable_split_ops=()) != Config()


# -- the automatic full graph: resolved per graph, from its cudagraphs and the compiler -------

AUTOMATIC = FullGraphOptions(capturable_split_ops=FULL, small_query_attention=True)


def test_the_default_full_graph_is_automatic():
    assert Config().full_graph == AUTO == "auto"
    assert Config(full_graph="auto") == Config.from_options({"full_graph": "auto"}) == Config()
    assert inspect.signature(Config).parameters["full_graph"].default == AUTO


def test_the_automatic_full_graph_captures_attention_with_cuda_graphs_only():
    assert Config().full_graph_for(cudagraphs=True) == AUTOMATIC
    assert Config().full_graph_for(cudagraphs=False) is None  # CPU: piecewise, as without it
    assert Config().full_graph_for(cudagraphs=True).capturable_ops.names == {"attention"}


def test_the_automatic_full_graph_lowers_attention_only_where_inductor_compiles():
    eager = Config(compiler="eager").full_graph_for(cudagraphs=True)
    assert eager == FullGraphOptions(capturable_split_ops=FULL, small_query_attention=False)
    assert automatic_full_graph("inductor") == AUTOMATIC


@pytest.mark.parametrize("off", [{"full_graph": None}, {"capturable_split_ops": ()}, {"capturable_split_ops": []}])
def test_full_graph_none_turns_the_automatic_full_graph_off(off):
    config = Config(**off)
    assert config.full_graph is None
    assert config.full_graph_for(cudagraphs=True) is None and config.full_graph_for(cudagraphs=False) is None
    assert dataclasses.replace(Config(), **off).full_graph is None


def test_a_written_full_graph_is_used_as_written_with_or_without_cuda_graphs():
    written = Config(capturable_split_ops=FULL)
    assert written.full_graph_for(cudagraphs=True) == written.full_graph_for(cudagraphs=False) == FullGraphOptions()
    whole = FullGraphOptions(full_graph_compile=True)
    assert Config(full_graph=whole).full_graph_for(cudagraphs=False) == whole


def test_the_automatic_default_keeps_the_checks_of_options_written_alone():
    Config(compiler="eager")  # the automatic small_query_attention follows the compiler: no error
    with pytest.raises(ConfigError, match=r"^small_query_attention: expected capturable_split_ops beside it"):
        Config(small_query_attention=True)
    with pytest.raises(ConfigError, match=r"^full_graph_compile: expected capturable_split_ops beside it"):
        dataclasses.replace(Config(), full_graph_compile=True)
    with pytest.raises(ConfigError, match=r"^inductor_options: expected an Inductor compile to patch"):
        Config(compiler="eager", inductor_options=TUNING)  # the automatic full graph compiles nothing there


def test_a_full_graph_needs_a_split_op_to_capture():
    with pytest.raises(ConfigError, match=r'^capturable_split_ops: expected at least one split op .*got \(\) \(tuple\); '
                                          r'write FullGraphOptions\(capturable_split_ops=\("attention",\)\), or '
                                          r'full_graph=None'):
        FullGraphOptions(capturable_split_ops=())
    assert FullGraphOptions().capturable_split_ops == FULL
    assert FullGraphOptions(capturable_split_ops=["attention"]).capturable_split_ops == FULL


@pytest.mark.parametrize("build, message", [
    (lambda: Config(sizes={"capture_size": (1, 2)}),
     r"^Sizes: expected a Sizes field, got unknown 'capture_size'; did you mean 'capture_sizes'\?"),
    (lambda: Sizes((1, 2)), r"^Sizes: expected keyword arguments only, got 1 positional"),
    (lambda: Config(sizes=(1, 2)), r"^sizes: expected a Sizes or a dict of its fields, got \(1, 2\) \(tuple\)"),
    (lambda: Config(full_graph=True),
     r"^full_graph: expected a FullGraphOptions, None, 'auto' or a dict of its fields, got True"),
    (lambda: Config(full_graph="on"), r"^full_graph: expected a FullGraphOptions, None, 'auto' or a dict"),
    (lambda: FullGraphOptions(full_graph_compile="yes"), r"^full_graph_compile: expected True or False, got 'yes' \(str\)"),
    (lambda: Config(full_graph_compile="yes"), r"^full_graph_compile: expected True or False, got 'yes'"),
    (lambda: Config(compile={"compiler": "tvm"}), r"^compiler: expected one of \('eager', 'inductor'\)"),
])
def test_groups_are_checked_as_the_flat_names_are(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_small_query_attention_needs_a_compile_in_either_form():
    message = r'^small_query_attention: expected compiler="inductor" or full_graph_compile=True beside it'
    with pytest.raises(ConfigError, match=message):
        Config(compiler="eager", full_graph=FullGraphOptions(small_query_attention=True))
    Config(compiler="eager", full_graph=FullGraphOptions(small_query_attention=True, full_graph_compile=True))


def test_docs_config_md_is_generated_from_the_declarations():
    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("config_docs", root / "tools" / "config_docs.py")
    config_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config_docs)
    text = config_docs.render()
    assert (root / "docs" / "config.md").read_text() == text, \
        "docs/config.md is out of date: run python tools/config_docs.py > docs/config.md"
    for name in FLAT_NAMES:
        assert f"`{name}`" in text, name


def test_capture_sizes_up_to_the_bound_are_accepted():
    assert Config(capture_sizes=(1, MAX_CAPTURE_SIZE)).sizes.capture_sizes == (1, MAX_CAPTURE_SIZE)


# -- the old names of the full-graph fields: accepted, with a DeprecationWarning ---------------

@pytest.mark.parametrize("old, new", [({"split_ops": ["attention"]}, {"capturable_split_ops": FULL}),
                                      ({"compile": True}, {"full_graph_compile": True})])
def test_the_old_full_graph_field_names_still_work_with_a_warning(old, new):
    with pytest.warns(DeprecationWarning, match=f"FullGraphOptions\\({next(iter(old))}=...\\) is deprecated: write "
                                                f"FullGraphOptions\\({next(iter(new))}=...\\)"):
        assert FullGraphOptions(**old) == FullGraphOptions(**new)
    with pytest.warns(DeprecationWarning):
        assert Config(full_graph=old) == Config(full_graph=FullGraphOptions(**new))


def test_an_old_and_a_new_name_together_are_refused():
    with pytest.raises(ConfigError, match=r"^FullGraphOptions: expected full_graph_compile once, got both compile and "
                                          r"full_graph_compile; write only full_graph_compile"):
        FullGraphOptions(compile=True, full_graph_compile=False)


# -- combinations that would be ignored are refused ------------------------------------------

def test_capture_input_dim_needs_capture_input():
    message = (r"^capture_input_dim: expected capture_input beside it \(the input whose dimension it names\), got "
               r"capture_input_dim=1 without capture_input; add capture_input=")
    for build in (lambda: Config(capture_input_dim=1), lambda: Sizes(capture_input_dim=1),
                  lambda: Config.from_options({"capture_input_dim": 1}),
                  lambda: dataclasses.replace(Config(capture_input="x", capture_input_dim=1), capture_input=None)):
        with pytest.raises(ConfigError, match=message):
            build()
    assert Config(capture_input="input_ids", capture_input_dim=1).sizes.capture_input_dim == 1


@pytest.mark.parametrize("field, value", [("reuse_output_buffers", True), ("check_addresses", True),
                                          ("capture_error_mode", "thread_local")])
def test_capture_options_need_cuda_graphs(field, value):
    message = (f"^{field}: expected cudagraphs=None or True beside it .*, got {field}={value!r} with "
               f"cudagraphs=False; leave {field} out, or drop cudagraphs=False")
    with pytest.raises(ConfigError, match=message):
        Config(cudagraphs=False, **{field: value})
    with pytest.raises(ConfigError, match=message):
        Config.from_options({"cudagraphs": False, field: value})
    group = FLAT_NAMES[field][0]
    for cudagraphs in (None, True):  # graphs on, or on where the model is on CUDA: kept
        assert getattr(getattr(Config(cudagraphs=cudagraphs, **{field: value}), group), field) == value
    default = getattr(getattr(Config(), group), field)
    Config(cudagraphs=False, **{field: default})  # written at its default: nothing is ignored


def test_every_ignored_capture_option_is_named():
    with pytest.raises(ConfigError, match=r"^reuse_output_buffers, check_addresses: expected cudagraphs=None or True"):
        Config(cudagraphs=False, reuse_output_buffers=True, check_addresses=True)


BREAKABLE_FIX = r"for breakable CUDA graphs write cgcompile.GraphManager\(model, cgcompile.Config\(use_breakable=True\)\)"


def test_use_breakable_is_refused_by_a_backend():
    with pytest.raises(ConfigError, match=r"^Backend: use_breakable: expected False \(a Backend runs compiled pieces; "
                                          r"use_breakable chooses a GraphManager's path\), got True; leave it out of "
                                          r"this Config, and " + BREAKABLE_FIX):
        cgcompile.Backend(Config(use_breakable=True))
    cgcompile.Backend(Config(use_breakable=False))


def test_use_breakable_is_refused_in_torch_compile_options():
    message = (r"^options: use_breakable: expected False \(torch.compile runs compiled pieces; .*\), got True; "
               r"remove it from options, and " + BREAKABLE_FIX)
    with pytest.raises(ConfigError, match=message):
        Config.from_options({"use_breakable": True})
    with pytest.raises(ConfigError, match=message):
        Config.from_options({"manager": {"use_breakable": True}})
    compiled = torch.compile(torch.sin, backend="cgcompile", options={"compiler": "eager", "use_breakable": True})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.ones(3))
    assert isinstance(info.value.inner_exception, ConfigError)
    assert "options: use_breakable: expected False" in str(info.value)


def test_use_breakable_is_read_by_the_graph_manager(monkeypatch):
    from cgcompile.testing.models import ToyLlama

    config = Config(use_breakable=True, compiler="eager", splitting_ops=[SILLY_OP])
    assert cgcompile.GraphManager(ToyLlama(1), config).use_breakable
    # the environment chose compiled pieces: the manager's Backend gets a Config without the flag
    monkeypatch.setenv("CGCOMPILE_USE_BREAKABLE", "0")
    manager = cgcompile.GraphManager(ToyLlama(1), config)
    assert not manager.use_breakable and manager.config is config
    assert manager.backend.config == dataclasses.replace(config, use_breakable=False)


# -- the engine reads one spelling: the groups -------------------------------------------------

ENGINE = pathlib.Path(cgcompile.__file__).resolve().parent


def _flat_reads(source: str) -> list[str]:
    """`<...>config.<flat name>` and `<...>cfg.<flat name>` reads in `source`: a Config read
    by an alias instead of its group (`config.sizes.capture_sizes` ends in a group, not in
    config, and passes)."""
    import ast

    reads = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FLAT_NAMES:
            receiver = node.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            if name.lower().endswith(("config", "cfg")):
                reads.append(f"{ast.unparse(node)} (line {node.lineno})")
    return reads


def test_the_scan_finds_flat_reads():
    source = "a = config.capture_sizes\nb = self.config.compiler\nc = build.cfg.padding\nd = config.sizes.capture_sizes\n"
    assert _flat_reads(source) == ["config.capture_sizes (line 1)", "self.config.compiler (line 2)",
                                   "build.cfg.padding (line 3)"]


def test_the_engine_reads_config_through_its_groups():
    found = {}
    for path in sorted(ENGINE.rglob("*.py")):
        if path != ENGINE / "config.py":
            found.update({f"{path.relative_to(ENGINE)}: {read}": None for read in _flat_reads(path.read_text())})
    assert not found, f"read these through their group (config.<group>.<field>): {list(found)}"
