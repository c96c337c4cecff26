"""Config: defaults, validation at construction, and the split-op predicate it builds."""

import dataclasses

import pytest
import torch

import cgcompile
from cgcompile import Config, ConfigError
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
