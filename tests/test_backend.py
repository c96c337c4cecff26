"""The backend as users reach it: by name, with options, and with Inductor."""

import json
import subprocess
import sys
import textwrap

import torch

import cgcompile
from cgcompile.testing.models import SILLY_OP, ToyLlama

BY_NAME = textwrap.dedent(
    """
    import sys
    import torch

    assert "cgcompile" not in sys.modules
    f = torch.compile(lambda x: (x.sin() @ x.T).relu(), backend="cgcompile", options={"compiler": "eager"})
    x = torch.randn(4, 4)
    assert torch.equal(f(x), (x.sin() @ x.T).relu())
    assert "cgcompile.backend" in sys.modules  # loaded through the entry point
    print("ok")
    """
)


def test_backend_by_name_without_import():
    result = subprocess.run([sys.executable, "-c", BY_NAME], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_options_become_config_fields(tmp_path):
    torch.manual_seed(0)
    model = ToyLlama(2)
    options = {"compiler": "eager", "splitting_ops": [SILLY_OP], "dump_dir": str(tmp_path)}
    ids = torch.randint(0, 64, (5,))
    assert torch.equal(torch.compile(model, backend="cgcompile", options=options)(ids), model(ids))
    with open(tmp_path / "graph_0" / "summary.json") as f:
        pieces = json.load(f)["pieces"]
    assert [p["capturable"] for p in pieces] == [True, False, True, False, True]


def test_default_config():
    backend = cgcompile.Backend()
    assert backend.config == cgcompile.Config()
    assert backend.pieces == []
    assert backend.stats == cgcompile.BackendStats()


def test_identical_pieces_compile_once_with_inductor():
    torch.manual_seed(0)
    model = ToyLlama(3)
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", splitting_ops=[SILLY_OP]))
    compiled = torch.compile(model, backend=backend)
    for n in (6, 11):
        ids = torch.randint(0, 64, (n,))
        torch._dynamo.mark_dynamic(ids, 0)
        torch.testing.assert_close(compiled(ids), model(ids))
    stats = backend.stats
    # First layer's piece (embedding + norm + qkv), the layer-to-layer piece shared by
    # both middle boundaries, and the last piece (o_proj + MLP + lm_head).
    assert (stats.graphs_seen, stats.pieces, stats.capturable_pieces, stats.compilations) == (1, 7, 4, 3)
    assert stats.graphs_captured == 0


def test_graph_outputs_are_copied_contiguous_only_where_eager_is_contiguous():
    # The copy out of a CUDA graph buffer takes eager's layout when that is contiguous
    # (Inductor may have chosen another); otherwise it keeps the buffer's layout.
    from cgcompile.phases import _statically_contiguous

    x = torch.empty(2, 3, 5, 4)
    assert _statically_contiguous(x)
    assert not _statically_contiguous(x.transpose(1, 2))
    assert not _statically_contiguous(x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3))
    assert _statically_contiguous(torch.empty(1, 3, 1, 4).as_strided((1, 3, 1, 4), (7, 4, 99, 1)))  # size-1 strides are free
    assert not _statically_contiguous(x[:, :, :4])  # a non-dense view
    assert not _statically_contiguous(3)
