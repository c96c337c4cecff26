"""Every example runs as a smoke test. An example that needs a GPU says so on a line of its own:

    # cgcompile-example: needs-cuda

An example that runs on several ranks says `# cgcompile-example: needs-torchrun`; it is
run under torchrun by tests/parallel/test_distributed.py instead.
"""

import pathlib
import re
import runpy
import subprocess
import sys

import pytest
import torch

from cgcompile.errors import DistributedError

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))
NEEDS_CUDA = "# cgcompile-example: needs-cuda"
NEEDS_TORCHRUN = "# cgcompile-example: needs-torchrun"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example):
    if NEEDS_TORCHRUN in example.read_text().splitlines():
        pytest.skip(f"{example.name} runs on 2 ranks: tests/parallel/test_distributed.py runs it under torchrun")
    if NEEDS_CUDA in example.read_text().splitlines() and not torch.cuda.is_available():
        pytest.skip(f"{example.name} needs a CUDA GPU; torch.cuda.is_available() is False")
    result = subprocess.run([sys.executable, str(example), *EXAMPLE_ARGS.get(example.name, ())], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.strip(), f"{example.name} printed nothing"
    for check, cpu_only in OUTPUT_CHECKS.get(example.name, ()):
        if not (cpu_only and torch.cuda.is_available()):
            check(result.stdout.splitlines())


PARALLEL_EXAMPLES = [e for e in EXAMPLES if NEEDS_TORCHRUN in e.read_text().splitlines()]


@pytest.mark.parametrize("example", PARALLEL_EXAMPLES, ids=lambda p: p.name)
def test_parallel_example_without_torchrun_says_how_to_run_it(example, monkeypatch):
    """Run in this process (runpy), as `python <example> --device cpu` would: the example's first
    step is `torchrun_worker`, and a subprocess would spend its time importing torch."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [str(example), "--device", "cpu"])
    with pytest.raises(DistributedError) as raised:
        runpy.run_path(str(example), run_name="__main__")
    message = str(raised.value)
    assert message.startswith("torchrun_worker: expected the environment torchrun"), message
    assert "torchrun --nproc-per-node 2 " in message and f"{example.name} --device cpu" in message, message
    assert not torch.distributed.is_initialized()


def toy_llama_prints_the_split(lines: list[str]) -> None:
    """examples/toy_llama.py at --layers 2 (EXAMPLE_ARGS): the piece table, and the summary."""
    assert lines[1].split() == ["piece", "capturable", "nodes", "inputs", "reason"]
    assert [line.split()[1] for line in lines[2:7]] == ["yes", "no", "yes", "no", "yes"]
    assert lines[-1] == "2 layers: 5 pieces, 3 capturable; outputs match eager"


def vision_encoder_on_cpu_claims_no_captures(lines: list[str]) -> None:
    assert lines[0] == "model vision: 6 of 6 sizes planned, 18 graphs (none captured yet), estimate unknown"
    assert lines[1].split()[-2:] == ["would", "capture"]
    assert not any("sizes captured" in line or "graphs captured" in line for line in lines)
    assert lines[-1].endswith("no CUDA graphs on CPU: the plans above count what a capture on a GPU would make; "
                              "nothing was captured")


def hf_static_generate_on_cpu_names_full_graph_calls_without_graphs(lines: list[str]) -> None:
    decode, tokens = lines
    assert " full-graph calls (no CUDA graphs on cpu: the compiled forward ran as one piece)" in decode
    assert "from the full graph" not in decode and decode.endswith("CUDA graphs captured: 0")
    assert tokens.startswith("greedy tokens identical to eager")


def test_hf_static_generate_through_generates_own_compile():
    """examples/hf_static_generate.py --generate-compile: generate() compiles only the decode
    step with the example's Backend, over one cache for both calls; tokens equal eager's."""
    example = next(e for e in EXAMPLES if e.name == "hf_static_generate.py")
    result = subprocess.run([sys.executable, str(example), "--generate-compile"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    decode, tokens = result.stdout.splitlines()
    assert tokens.startswith("greedy tokens identical to eager"), tokens
    full, piecewise = (int(n) for n in re.search(r"decode calls: (\d+) full-graph calls .*, (\d+) piecewise",
                                                  decode).groups())
    assert full > 0 and full + piecewise == 2 * 23, decode  # two calls of 24 tokens: only decode steps compiled


def plain_decode_loop_gives_generates_tokens(lines: list[str]) -> None:
    """examples/hf_decode_loop.py: a greedy loop over a StaticCache, compiled, with the next
    token and the cache position kept on the device, gives generate()'s tokens."""
    assert lines[-1] == "tokens match generate(): True", lines


def hf_generate_eager_pieces_make_two_graphs_labelled_prefill_and_decode(lines: list[str]) -> None:
    """examples/hf_generate.py with eager pieces on the CPU (its Inductor run, with a third graph
    and the reason for it, is tests/test_hf_generate_example.py's)."""
    out = "\n".join(lines)
    assert int(re.search(r"graphs_seen=(\d+)", out).group(1)) == 2, out
    graphs = [line.split(":")[0] for line in lines if re.match(r"graph \d+ \(", line)]
    assert graphs == ["graph 0 (prefill)", "graph 1 (every decode step)"], out
    assert "pieces of graph 1 (every decode step):" in out
    assert "stride guard" not in out


# What an example's smoke run (its default arguments, or EXAMPLE_ARGS) prints, checked on
# that run (one run each): (check, whether only a run without CUDA says it).
OUTPUT_CHECKS = {
    "hf_generate.py": [(hf_generate_eager_pieces_make_two_graphs_labelled_prefill_and_decode, True)],
    "toy_llama.py": [(toy_llama_prints_the_split, False)],
    "vision_encoder.py": [(vision_encoder_on_cpu_claims_no_captures, True)],
    "hf_static_generate.py": [(hf_static_generate_on_cpu_names_full_graph_calls_without_graphs, True)],
    "hf_decode_loop.py": [(plain_decode_loop_gives_generates_tokens, False)],
}


# Arguments of an example's smoke run, where not its defaults.
EXAMPLE_ARGS = {"toy_llama.py": ("--layers", "2"),
                "hf_generate.py": ("--layers", "1", "--hidden", "64", "--prompt-len", "4", "--new-tokens", "4")}


def test_output_checks_name_examples():
    assert set(OUTPUT_CHECKS) | set(EXAMPLE_ARGS) <= {e.name for e in EXAMPLES}
