"""`python -m cgcompile.inspect`: the 120-column table, one piece in full, several runs, the HTML page."""

import json
from html.parser import HTMLParser

import torch

import cgcompile
from cgcompile import MemoryPlan, SizePlan
from cgcompile.tools import inspect_dump as inspect
from cgcompile.tools.memory_plan import write_plan
from cgcompile.testing.models import SILLY_OP, ToyLlama

ATTENTION_REASON = "attn: scaled_dot_product_attention is split by default (attention) [split_op]"
CACHE_REASON = "keys: output shape (1, 2, s5 + 1, 32) depends on the dynamic size s5 [dynamic_shape]"


def compile_toy(dump_dir):
    torch.manual_seed(0)
    model = ToyLlama(2)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", splitting_ops=[SILLY_OP], dump_dir=dump_dir))
    ids = torch.randint(0, 64, (5,))
    torch._dynamo.mark_dynamic(ids, 0)
    torch.compile(model, backend=backend)(ids)
    return backend


def write_static_summary(folder, index=0):
    """A graph like a Hugging Face decode step at batch 1: no capture dimension."""
    pieces = [
        {"piece": f"graph{index}.piece_0", "capturable": True, "nodes": 46, "inputs": ["int64[1, 1]"] * 8,
         "reason": None},
        {"piece": f"graph{index}.piece_1", "capturable": False, "nodes": 3,
         "inputs": ["float32[1, 2, s5, 32]", "float32[1, 8, 1, 32]"], "reason": f"{CACHE_REASON}; {ATTENTION_REASON}"},
        {"piece": f"graph{index}.piece_2", "capturable": True, "nodes": 31, "inputs": ["float32[1, 8, 1, 32]"],
         "reason": None},
    ]
    summary = {"graph_index": index, "capture_dim": "None", "sizes": "static: the graph has no capture dimension",
               "full_graph": None, "pieces": pieces}
    (folder / f"graph_{index}").mkdir(parents=True)
    (folder / f"graph_{index}" / "summary.json").write_text(json.dumps(summary))


def run_inspect(capsys, *args):
    code = inspect.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_table_fits_120_columns(tmp_path, capsys):
    backend = compile_toy(str(tmp_path))
    code, out, _ = run_inspect(capsys, tmp_path)
    assert code == 0
    lines = out.splitlines()
    assert all(len(line) <= inspect.WIDTH for line in lines)
    assert lines[0].startswith("graph0: capture dimension s") and "5 pieces, 3 capturable" in lines[0]
    header = next(line for line in lines if line.split()[:1] == ["piece"])
    assert header.split() == ["piece", "kind", "nodes", "inputs", "sizes", "reason"]
    row = next(line for line in lines if line.split()[:1] == ["graph0.piece_1"])
    assert row.split()[1:3] == ["eager", str(backend.pieces[1].node_count)]
    assert row.endswith(inspect.short_reason(backend.pieces[1].reason)) and "split_op at" in row
    assert "why static" not in out


def test_static_graph_says_what_to_set(tmp_path, capsys):
    write_static_summary(tmp_path)
    code, out, _ = run_inspect(capsys, tmp_path)
    assert code == 0
    assert "graph0: static (no capture dimension); 3 pieces, 2 capturable (77 of 80 nodes)" in out
    assert "Config(capture_input=..., capture_input_dim=...)" in out and "The capture dimension" in out
    assert "graph0.piece_1  eager" in out and "dynamic_shape, split_op at keys (+1)" in out


def test_one_piece_in_full(tmp_path, capsys):
    write_static_summary(tmp_path)
    for wanted in ("1", "graph0.piece_1"):
        code, out, _ = run_inspect(capsys, tmp_path, "--piece", wanted)
        assert code == 0
        lines = out.splitlines()
        assert lines[0] == f"graph0.piece_1: eager, 3 nodes, code {tmp_path / 'graph_0' / 'piece_1.py'}"
        assert f"  reason: {ATTENTION_REASON}" in lines and "  input 0: float32[1, 2, s5, 32]" in lines
    code, out, _ = run_inspect(capsys, tmp_path, "--verbose")
    assert code == 0 and "  input 0: float32[1, 2, s5, 32]" in out and "piece  " in out  # tables, then pieces
    code, _, err = run_inspect(capsys, tmp_path, "--piece", "graph7.piece_0")
    assert code == 1 and "--piece: expected a piece of the dump" in err


def test_several_runs_get_their_own_labels(tmp_path, capsys):
    write_static_summary(tmp_path / "run_a")
    write_static_summary(tmp_path / "run_b")
    runs = inspect.read_dump(str(tmp_path))
    labels = [p.label for run in runs for g in run.graphs for p in g.pieces]
    assert labels[:2] == ["run_a/graph0.piece_0", "run_a/graph0.piece_1"] and len(set(labels)) == 6
    code, out, _ = run_inspect(capsys, tmp_path, "--piece", "run_b/graph0.piece_2")
    assert code == 0 and out.startswith("run_b/graph0.piece_2: capturable")
    single = tmp_path / "single"
    write_static_summary(single / "run_c")
    assert [g.label for run in inspect.read_dump(str(single)) for g in run.graphs] == ["graph0"]


class PageParser(HTMLParser):
    """The strips (one per graph), their piece boxes, every URL-bearing attribute, the text."""

    def __init__(self):
        super().__init__()
        self.strips, self.urls, self.text, self.tables = [], [], [], 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if "strip" in classes:
            self.strips.append((attrs["data-graph"], []))
        if "piece" in classes:
            self.strips[-1][1].append((classes[1], attrs["title"]))
        self.urls += [attrs[k] for k in ("href", "src") if k in attrs]
        self.tables += tag == "table"

    def handle_data(self, data):
        self.text.append(data)


def test_html_page(tmp_path, capsys):
    write_static_summary(tmp_path)
    write_static_summary(tmp_path, index=1)
    write_plan(str(tmp_path), MemoryPlan("decoder", (SizePlan(8, 5, 48 << 20), SizePlan(1, 5, 50 << 20)), (8, 1)))
    page = tmp_path / "split.html"
    code, out, _ = run_inspect(capsys, tmp_path, "--html", page)
    assert code == 0 and out.endswith(f"wrote {page}\n")
    html = page.read_text()
    parser = PageParser()
    parser.feed(html)
    assert [label for label, _ in parser.strips] == ["graph0", "graph1"]
    kinds = [kind for _, boxes in parser.strips for kind, _ in boxes]
    assert kinds == ["capturable", "eager", "capturable"] * 2
    eager_title = parser.strips[0][1][1][1]
    assert ATTENTION_REASON in eager_title and CACHE_REASON in eager_title
    text = " ".join(parser.text)
    assert "2 capturable (77 of 80 nodes)" in text and "Config(capture_input=..., capture_input_dim=...)" in text
    assert "memory plan: model decoder" in text and parser.tables == 1
    assert parser.urls == [] and "http" not in html and "url(" not in html and "<script" not in html


class CellParser(HTMLParser):
    """The text of every <th> and <td>, in order."""

    def __init__(self):
        super().__init__()
        self.cells, self._open = [], False

    def handle_starttag(self, tag, attrs):
        self._open = tag in ("th", "td")

    def handle_data(self, data):
        if self._open:
            self.cells.append(data)
            self._open = False


def test_html_plan_made_before_a_capture_says_would_capture(tmp_path, capsys):
    # Planned on CPU: nothing captured; 4 is planned but not a capture size, so it runs at 8.
    plan = MemoryPlan("decoder", (SizePlan(8, 5, None), SizePlan(4, 5, None)), (8, 4), capture_sizes=(8,))
    write_plan(str(tmp_path), plan)
    page = tmp_path / "split.html"
    code, out, _ = run_inspect(capsys, tmp_path, "--html", page)
    assert code == 0 and "would capture" in out
    parser = CellParser()
    parser.feed(page.read_text())
    header, rows = parser.cells[:4], parser.cells[4:]
    assert header == ["size", "graphs", "pool after", "would capture"]
    assert rows[3::4] == ["yes", "no: not a capture size (runs at 8)"]


def test_html_path_that_cannot_be_written_is_one_line_before_the_table(tmp_path, capsys):
    write_static_summary(tmp_path / "dump")
    for path, says in ((tmp_path, "got the folder"), (tmp_path / "missing" / "x.html", "does not exist")):
        code, out, err = run_inspect(capsys, tmp_path / "dump", "--html", path)
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and str(path) in err and says in err
        assert "Traceback" not in err
