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
    assert config.capture_sizes == (1, 2, 4) + tuple(range(8, 257, 8))
    assert config.max_capture_size == 256
    assert config.compiler == "inductor"
    assert config.cudagraphs is None
    assert config.dump_dir is None
    assert config.splitting_ops == ()


def test_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().compiler = "eager"
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
                     full_graph=FullGraphOptions(split_ops=FULL, compile=True))
    as_dicts = Config.from_options({"sizes": {"capture_sizes": [1, 2]}, "compile": {"compiler": "eager"},
                                    "full_graph": {"compile": True}})
    assert flat == grouped == as_dicts and hash(flat) == hash(grouped)
    assert flat.full_graph == FullGraphOptions(split_ops=FULL, compile=True, small_query_attention=False)


def test_every_flat_name_reads_its_group_field():
    config = Config(full_graph=FullGraphOptions(compile=True))
    for name, (part, field) in FLAT_NAMES.items():
        assert getattr(config, name) == getattr(getattr(config, part), field), name
    assert (config.capturable_split_ops, config.full_graph_compile) == (FULL, True)
    # no full graph: the flat reads see no capturable ops and the other options off
    off = Config(full_graph=None)
    assert (off.capturable_split_ops, off.full_graph_compile, off.small_query_attention) == ((), False, False)
    # the automatic default: the options a graph with CUDA graphs gets, none where cudagraphs=False
    assert (Config().capturable_split_ops, Config().full_graph_compile, Config().small_query_attention) == \
        (FULL, False, True)
    assert Config(compiler="eager").small_query_attention is False
    assert Config(cudagraphs=False).capturable_split_ops == () and not Config(cudagraphs=False).capturable_ops


def test_the_flat_names_come_from_the_group_declarations():
    declared = [(part.name, f.name) for part in dataclasses.fields(Config)
                for f in dataclasses.fields(part.metadata["group"])]
    assert sorted(FLAT_NAMES.values()) == sorted(declared)  # each group field has one flat name, none twice
    assert FLAT_NAMES["capturable_split_ops"] == ("full_graph", "split_ops")
    assert FLAT_NAMES["capture_sizes"] == ("sizes", "capture_sizes")
    assert set(inspect.signature(Config).parameters) == set(FLAT_NAMES) | {p.name for p in dataclasses.fields(Config)}


def test_flat_names_beside_their_group_are_applied_on_top():
    config = Config(sizes=Sizes(capture_sizes=(4,), padding=True), capture_sizes=(1, 2))
    assert config.sizes == Sizes(capture_sizes=(1, 2), padding=True)
    assert dataclasses.replace(config, compiler="eager").compiler == "eager"
    whole = Config(full_graph=FullGraphOptions(compile=True))
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
    assert dict(config.inductor_options) == fields.get("inductor_options", {})
    assert dict(config.size_inductor_options) == fields.get("size_inductor_options", {})


def test_full_graph_options_at_their_defaults_need_no_capturable_ops():
    assert Config(full_graph_compile=False, small_query_attention=False, capturable_split_ops=()).full_graph is None
    assert Config(full_graph=None) == Config(capturable_split_ops=()) != Config()


# -- the automatic full graph: resolved per graph, from its cudagraphs and the compiler -------

AUTOMATIC = FullGraphOptions(split_ops=FULL, small_query_attention=True)


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
    assert eager == FullGraphOptions(split_ops=FULL, small_query_attention=False)
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
    whole = FullGraphOptions(compile=True)
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
                                          r'write FullGraphOptions\(split_ops=\("attention",\)\), or full_graph=None'):
        FullGraphOptions(split_ops=())
    assert FullGraphOptions().split_ops == FULL and FullGraphOptions(split_ops=["attention"]).split_ops == FULL


@pytest.mark.parametrize("build, message", [
    (lambda: Config(sizes={"capture_size": (1, 2)}),
     r"^Sizes: expected a Sizes field, got unknown 'capture_size'; did you mean 'capture_sizes'\?"),
    (lambda: Sizes((1, 2)), r"^Sizes: expected keyword arguments only, got 1 positional"),
    (lambda: Config(sizes=(1, 2)), r"^sizes: expected a Sizes or a dict of its fields, got \(1, 2\) \(tuple\)"),
    (lambda: Config(full_graph=True),
     r"^full_graph: expected a FullGraphOptions, None, 'auto' or a dict of its fields, got True"),
    (lambda: Config(full_graph="on"), r"^full_graph: expected a FullGraphOptions, None, 'auto' or a dict"),
    (lambda: FullGraphOptions(compile="yes"), r"^full_graph_compile: expected True or False, got 'yes' \(str\)"),
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
    Config(compiler="eager", full_graph=FullGraphOptions(small_query_attention=True, compile=True))


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
    assert Config(capture_sizes=(1, MAX_CAPTURE_SIZE)).capture_sizes == (1, MAX_CAPTURE_SIZE)
