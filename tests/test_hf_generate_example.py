"""examples/hf_generate.py labels each Dynamo graph by what it serves, and says why there
is a third graph where there is one (Inductor pieces without CUDA graphs). The run with eager
pieces (two graphs, prefill and decode) is the example's smoke run in tests/test_examples.py,
at the same small arguments."""

import pathlib
import re
import subprocess
import sys

import pytest
import torch

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "hf_generate.py"
SMALL = ("--layers", "1", "--hidden", "64", "--prompt-len", "4", "--new-tokens", "4")


def _graph_lines(compiler: str) -> tuple[list[str], str, int]:
    """The "graph i (role)" lines of a small run, all it printed, and its graphs_seen."""
    result = subprocess.run([sys.executable, str(EXAMPLE), "--compiler", compiler, *SMALL], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    graphs = int(re.search(r"graphs_seen=(\d+)", result.stdout).group(1))
    return [line for line in result.stdout.splitlines() if re.match(r"graph \d+ \(", line)], result.stdout, graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU run, where pieces run without CUDA graphs")
def test_inductor_pieces_on_cpu_make_three_graphs_and_say_why():
    lines, out, graphs = _graph_lines("inductor")
    assert graphs == 3
    assert [line.split(":")[0] for line in lines] == [
        "graph 0 (prefill)", "graph 1 (first decode step)", "graph 2 (every later decode step)"]
    assert "pieces of graph 2 (every later decode step):" in out
    assert "fails graph 1's stride guard on past_key_values" in out
