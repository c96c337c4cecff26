"""benchmarks/model_zoo_beyond.py: a CPU subset of the zoo of models that are not transformers.

A graph network (torch_geometric) and a diffusion transformer (diffusers) run the size
sequence on one compiled model with compiler="eager" (pieces as FX code: the split is the
one Inductor would get, without minutes of C++ compiles on CI's two cores); a torchvision
and a timm classifier run where those packages import. The judging (errors, "upstream"
rows), the comparison of nested outputs and the command line are checked without models.
"""

import importlib.util
import pathlib
import sys

import pytest
import torch

ZOO_PATH = pathlib.Path(__file__).parent.parent / "benchmarks" / "model_zoo_beyond.py"


def load_zoo():
    spec = importlib.util.spec_from_file_location("model_zoo_beyond", ZOO_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there (Python 3.12)
    spec.loader.exec_module(module)
    return module


beyond = load_zoo()
CPU = beyond.Options(device="cpu", compiler="eager", sequence=(1, 3, 1))
PACKAGE = {"gcn": "torch_geometric", "dit": "diffusers", "resnet18": "torchvision", "timm_resnet18": "timm"}


@pytest.mark.parametrize("name", list(PACKAGE))
def test_cpu_subset_matches_eager_through_the_sequence(name, one_thread):
    pytest.importorskip(PACKAGE[name])
    rows = beyond.run_zoo([name], CPU)
    assert [(row.call, row.size) for row in rows] == list(enumerate(CPU.sequence))
    for row in rows:
        assert (row.status, row.error) == ("ok", None), f"call {row.call}: {row.note}"
        assert row.max_err <= 1e-4 and row.pieces > 0 and row.graphs_captured == 0
    # One compiled model: batch 1 again reuses the graphs the first two calls made.
    assert rows[-1].graphs == rows[-2].graphs >= rows[0].graphs


def test_graph_batches_have_more_nodes_at_larger_sizes():
    pytest.importorskip("torch_geometric")
    one, three = (beyond.graphs(size, torch.Generator().manual_seed(0)) for size in (1, 3))
    assert one[0].shape[1] == three[0].shape[1] == 16
    assert 6 <= one[0].shape[0] <= 12 < 18 <= three[0].shape[0] <= 36
    assert int(three[1].max()) < three[0].shape[0]  # edges index the batch's nodes


def test_missing_package_rows_are_skips():
    entry = beyond.Entry("absent", "no_such_package_here", "graph", lambda: None, beyond.images)
    rows = beyond.run_model(entry, CPU)
    assert [(row.status, row.note) for row in rows] == [("skip", "no_such_package_here not installed")] * 3


def test_compare_flattens_nested_outputs_and_sees_a_difference():
    expected = [{"boxes": torch.ones(2, 4), "labels": torch.tensor([1, 2]), "empty": torch.zeros(0)}]
    got = [{"boxes": torch.ones(2, 4), "labels": torch.tensor([1, 2]), "empty": torch.zeros(0)}]
    assert beyond.compare(got, expected) == 0.0
    got[0]["boxes"][1, 3] = 1.5
    assert beyond.compare(got, expected) == pytest.approx(0.5)
    got[0]["boxes"] = torch.ones(3, 4)  # another number of detections
    with pytest.raises(ValueError, match="expected output shapes"):
        beyond.compare(got, expected)
    with pytest.raises(ValueError, match="non-empty"):
        beyond.compare([torch.zeros(0)], [torch.zeros(0)])


@pytest.mark.parametrize(
    "reference_err, status",
    [(None, "FAIL"), (1e-6, "FAIL"), (0.05, "FAIL"), (0.3, "upstream"), (2.0, "upstream")],
)
def test_judge_marks_errors_plain_torch_compile_shares_upstream(reference_err, status):
    row = beyond.Row("gcn", "graph", 1, max_err=1.0, reference_err=reference_err, family="torch_geometric")
    beyond.judge(row, CPU)
    assert row.status == status
    assert row.note.startswith("max err 1.00e+00 > 0.0001")


def test_judge_reports_an_error_in_the_reference_without_failing_the_row():
    row = beyond.Row("gcn", "graph", 1, max_err=0.0, reference_error="BackendCompilerFailed: boom")
    beyond.judge(row, CPU)
    assert (row.status, row.note) == ("ok", "plain torch.compile: BackendCompilerFailed: boom")


def test_select_takes_names_kinds_and_families_and_rejects_others():
    assert beyond.select(["dit", "graph"]) == ["gcn", "gat", "graphsage", "gin", "dit"]
    assert beyond.select(["timm"]) == [e.name for e in beyond.ENTRIES if e.family == "timm"]
    with pytest.raises(SystemExit) as exit_info:
        beyond.parse_args(["--models", "gcn,gpt5"])
    assert exit_info.value.code == 2


def test_list_names_every_model(capsys):
    assert beyond.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [e.name for e in beyond.ENTRIES]
    assert {e.family for e in beyond.ENTRIES} == set(beyond.FAMILIES)


@pytest.mark.parametrize("name", [entry.name for entry in beyond.ENTRIES])
def test_every_model_runs_eagerly_on_its_zoo_inputs(name, one_thread):
    """The zoo's inputs suit each model (RAFT's smallest images, WavLM without lengths):
    an input the model rejects would fail every row before cgcompile is reached."""
    entry = beyond.BY_NAME[name]
    pytest.importorskip(entry.family)
    model = beyond.build(entry, CPU)
    row = beyond.Row(name, entry.kind, 3, call=0)
    with torch.inference_mode():
        output = model(*beyond.make_inputs(entry, row, CPU))
    assert any(t.numel() for t in beyond.zoo.output_tensors(output))
