"""The differential fuzzer (`cgcompile.fuzz`): its generator, then cgcompile against eager
on random programs, padded to the capture sizes on the CPU and replayed from CUDA graphs
on the GPU. Zero mismatches is the bar; `KNOWN_BUGS` names what is open."""

import dataclasses
import functools
import subprocess
import sys
from typing import Callable

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

import cgcompile
from cgcompile.testing import fake_graphs, fuzz
from cgcompile.compat import fresh_inductor_cache
from cgcompile.testing.grammar import LAYOUTS, MODES, N, RETURNS, Program


@dataclasses.dataclass(frozen=True)
class KnownBug:
    """A bug the fuzzer found. While it is open (in `KNOWN_BUGS`), a failing case whose
    program uses a production from each set in `needs` counts as this bug: the test
    reports xfail and lists the cases; any other failure fails the test. Each of `models`
    shows the bug at n=3, padded to 4: `test_known_bug_reproduces` fails once it is
    fixed, so that the entry moves to `FIXED_BUGS`, where the models stay as tests."""

    what: str
    needs: tuple[frozenset[str], ...]
    models: tuple[Callable[[], Callable], ...]

    def explains(self, program: Program) -> bool:
        return all(group & set(program.productions) for group in self.needs)


VIEWS = frozenset({"unflatten", "transpose", "unsqueeze", "chunk", "slice_cols", "select_row"})
WRITES = frozenset({"inplace_scale", "inplace_add", "inplace_slice", "inplace_row", "split_accumulate"})


def _write_into_a_piece_input(x):  # x: [n, 8]
    t = torch.ops.cgcompile_testing.silly_attention(x, x, x)  # an eager piece: n rows
    t.mul_(2.0)  # the next, capturable piece writes into t
    return t


def _write_through_a_view(x):  # x: [n, 8]
    t = torch.ops.cgcompile_testing.silly_attention(x, x, x)  # an eager piece: n rows
    v = t[:, :4]  # made in the next, capturable piece, with u
    u = v * 2.0
    torch.ops.cgcompile_testing.silly_accumulate(v, u)  # an eager piece writes into t through v
    return t


def _write_into_a_viewed_tensor(x):  # x: [n, 8]
    t = torch.ops.cgcompile_testing.silly_attention(x, x, x)  # an eager piece: n rows
    v = t[:, :4]  # made in the next, capturable piece, with u
    u = v * 2.0
    t.add_(1.0)  # v must see it
    return v, u


def _write_through_a_reshape(x):  # x: [n, 8]
    t = torch.ops.cgcompile_testing.silly_attention(x, x, x)  # an eager piece: n rows
    t.reshape(t.shape[0], 2, 4).mul_(2.0)  # reshape returns a view of t here: the write reaches t
    return t


class _WriteIntoAGather(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(32, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):  # x: [n, 8]
        ids = (x[:, 0].abs() * 8).long() % 32
        t = self.table[ids]  # advanced indexing: a copy, not a view of the table
        s = torch.ops.cgcompile_testing.silly_attention(x, x, x)
        t.mul_(s)  # a write into what an earlier piece made
        return t


class _CacheWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.ones(16, 8))

    def forward(self, x):  # x: [n, 8]
        self.cache[: x.shape[0]] = x.sin()  # rows n.. must keep their ones
        return self.cache * 1.0


KNOWN_BUGS = ()


class _AccumulateIntoAnInput(torch.nn.Module):
    def forward(self, x, out):  # x, out: [n, 8]; returns nothing
        torch.ops.cgcompile_testing.silly_accumulate(out, x * 2.0)  # its one effect: a write into out


class _AccumulateIntoAViewOfAnInput(torch.nn.Module):
    def forward(self, x, out):  # x, out: [n, 8]; returns nothing
        torch.ops.cgcompile_testing.silly_accumulate(out[:, 2:], x[:, :6] * 2.0)  # a captured op views out


SINKS = frozenset(p.name for p in fuzz.PRODUCTIONS if p.family == "sink")

# The breakable path's (`Setup(path="breakable")`); each model shows the bug over three
# calls of n=3 (observe, capture, replay).
BREAKABLE_KNOWN_BUGS = ()

BREAKABLE_FIXED_BUGS = (
    KnownBug(
        "a split op's write into an input the model is handed missed the caller's tensor on the "
        "calls that observe and capture a size (they ran on copies of the inputs), and on every "
        "call once a captured op read the input (the write landed in its static buffer)",
        (SINKS,),
        (_AccumulateIntoAnInput, _AccumulateIntoAViewOfAnInput),
    ),
)

FIXED_BUGS = (
    KnownBug(
        "an in-place write into a piece's input (an intermediate an earlier piece produced) "
        "was lost when the piece ran padded: it wrote into the padded copy",
        (WRITES,),
        (lambda: _write_into_a_piece_input,),
    ),
    KnownBug(
        "a write of the rows into a buffer at their positions (buf[:n] = v, index_copy_ at "
        "arange(n)) in a padded piece wrote the padding rows too, over rows n.. of the buffer",
        (frozenset({"buffer_write"}),),
        (_CacheWrite,),
    ),
    KnownBug(
        "a view a padded piece made of its input viewed the padded copy, not the input: a "
        "later write through the view missed the input, a later write into the input missed the view",
        (VIEWS, WRITES),
        (lambda: _write_through_a_view, lambda: _write_into_a_viewed_tensor),
    ),
    KnownBug(
        "indexing by a tensor (table[ids], x[i]) was taken for a view: a later in-place write "
        "into its result (a copy an earlier piece made) was taken for a write into the table "
        "and stayed in a padded piece, which wrote into its padded copy",
        (frozenset({"embedding", "index_rows"}), WRITES),
        (_WriteIntoAGather,),
    ),
    KnownBug(
        "a write through the result of reshape (a view when the strides allow) into a value an "
        "earlier piece made was not taken for a write into that value: the piece ran padded, "
        "or from a graph, and wrote into its copy; and a warm-up before capture wrote into the "
        "copy the capture then started from, so the write was applied twice",
        (frozenset({"regroup_rows"}), WRITES),
        (lambda: _write_through_a_reshape,),
    ),
)

def _past_bug_shapes(seeds) -> list[int]:
    """The seeds whose programs combine the productions of a fixed bug (`FIXED_BUGS`): the
    shapes the padded path once failed on."""
    return [s for s in seeds if any(bug.explains(fuzz.generate(s)) for bug in FIXED_BUGS)]


# Of range(240) (the CPU's seeds until the CI time was trimmed): the first 20, which draw every
# production, and each later seed of a past bug's shape. The GPU's 1000 seeds and
# gpu_verify.sh's fuzz jobs draw the rest of the grammar; test_the_cpu_seeds_draw_every_production checks it.
CPU_SEEDS = sorted(set(range(20)) | set(_past_bug_shapes(range(240))))
FULL_GRAPH_SEEDS = range(0, 120, 2)  # every production, mode, layout and return; the GPU runs range(0, 1000, 4)
CPU_INDUCTOR_SEEDS = [s for s in range(100) if fuzz.generate(s).mode != "any"][:5]  # mostly padded
GPU_SEEDS = range(1000)
GPU_INDUCTOR_SEEDS = range(0, 1000, 20)


def _fuzz(seeds, setup: fuzz.Setup, bugs=None) -> tuple[list[str], list[str], int, int]:
    """Run the seeds; returns (failures through known bugs, one line each; shrunk
    reproducers of every other failure; calls that took the full path; linears fused).
    bugs: the known bugs (default KNOWN_BUGS, the compiled path's)."""
    bugs = KNOWN_BUGS if bugs is None else bugs
    known, new, full_calls, fused = [], [], 0, 0
    for seed in seeds:
        program, sizes = fuzz.generate(seed), fuzz.case_sizes(seed)
        outcome = fuzz.run_case(program, sizes, setup)
        full_calls += outcome.full_calls
        fused += outcome.fused_linears
        if outcome.status not in fuzz.FAILURES:
            continue
        explained = [bug.what for bug in bugs if bug.explains(program)]
        if explained:
            known.append(f"seed {seed}: {outcome.status} at n={outcome.size} ({'; '.join(explained)})")
        else:
            check = functools.partial(fuzz.run_case, setup=setup)
            program, sizes, outcome = fuzz.shrink(program, sizes, outcome, check, budget_s=30)
            new.append(fuzz.reproducer(program, sizes, setup, outcome))
    return known, new, full_calls, fused


def _assert_only_known_bugs(seeds, setup: fuzz.Setup) -> None:
    known, new, full_calls, fused = _fuzz(seeds, setup)
    assert not new, f"{len(new)} failures outside KNOWN_BUGS; reproducers:\n\n" + "\n\n".join(new)
    if setup.full_graph != "off":  # the full path ran, or the test would check nothing new
        assert full_calls >= len(seeds), f"only {full_calls} calls took the full path"
    if setup.fuse_sibling_linears:  # likewise: linears were fused
        assert fused >= len(seeds), f"only {fused} linears were fused in {len(seeds)} cases"
    if known:
        pytest.xfail(f"{len(known)} of {len(seeds)} cases fail, all through KNOWN_BUGS:\n" + "\n".join(known))


# -- the generator ---------------------------------------------------------------------------


def test_a_seed_always_gives_the_same_program_and_sizes():
    assert fuzz.source(fuzz.generate(7)) == fuzz.source(fuzz.generate(7))
    assert fuzz.case_sizes(7) == fuzz.case_sizes(7)
    assert fuzz.source(fuzz.generate(7)) != fuzz.source(fuzz.generate(8))


def test_every_production_is_reachable():
    programs = [fuzz.generate(seed) for seed in range(500)]
    used = {p for program in programs for p in program.productions}
    assert used == {p.name for p in fuzz.PRODUCTIONS if p.family != "state"}  # state: test_fuzz_sequences.py
    splits = {p.name for p in fuzz.PRODUCTIONS if p.family == "split"}
    assert any(p.productions[0] in splits for p in programs)  # a split op first
    assert any(p.productions[-1] in splits for p in programs)  # ... and last
    assert any(a in splits and b in splits for p in programs for a, b in zip(p.productions, p.productions[1:]))
    inputs = {v.name for p in programs for v in p.used_inputs()}
    assert inputs == {"x", "y", "ids", "out"}
    assert {p.mode for p in programs} == set(MODES)
    assert {p.layout for p in programs} == set(LAYOUTS)
    assert {p.returns for p in programs} == set(RETURNS)


def test_sinks_end_programs_and_write_only_into_the_input_made_for_them():
    programs = [fuzz.generate(seed) for seed in range(300)]
    for p in programs:
        sinks = [i for i, name in enumerate(p.productions) if name in SINKS]
        assert sinks in ([], [len(p.steps) - 1]), p.productions  # one, last, or none
        assert [v.name for v in p.written_inputs] == (["out"] if sinks else [])
        assert p.returns == "outputs" or sinks
    assert not any(SINKS & set(fuzz.generate(seed, stateful=True).productions) for seed in range(100))


def test_a_lost_write_into_an_input_or_a_wrong_return_shows_as_a_mismatch():
    program = next(p for p in map(fuzz.generate, range(100)) if p.returns == "nothing")
    namespace = fuzz.load(program)
    names = [v.name for v in program.written_inputs]
    written = tuple(i for i, v in enumerate(program.used_inputs()) if v in program.written_inputs)
    for stub, detail in ((lambda *inputs: None, "output out"), (lambda *inputs: (), "returned tuple")):
        with torch.no_grad():
            outcome = fuzz._run_size(namespace["make_inputs"], namespace["Model"](), stub, 5, "cpu", names, 0, written)
        assert outcome.status == "mismatch" and detail in outcome.detail, outcome


@pytest.mark.parametrize("seeds", [CPU_SEEDS, FULL_GRAPH_SEEDS], ids=["padded", "full_graph"])
def test_the_cpu_seeds_draw_every_production(seeds):
    # The CPU runs a subset of the seeds: it must still reach the whole grammar.
    programs = [fuzz.generate(seed) for seed in seeds]
    assert {p for program in programs for p in program.productions} == {
        p.name for p in fuzz.PRODUCTIONS if p.family != "state"}
    assert {p.mode for p in programs} == set(MODES)
    assert {p.layout for p in programs} == set(LAYOUTS)
    assert {p.returns for p in programs} == set(RETURNS)


def test_sizes_cover_capture_sizes_between_and_above():
    for seed in range(50):
        sizes = fuzz.case_sizes(seed)
        assert sizes[0] > 2  # n=1 would make Dynamo's first graph static; see case_sizes for 2
        assert set(sizes) & set(fuzz.CAPTURE_SIZES)
        assert [n for n in sizes if n < max(fuzz.CAPTURE_SIZES) and n not in fuzz.CAPTURE_SIZES]
        assert [n for n in sizes if n > max(fuzz.CAPTURE_SIZES)]


def test_programs_trace_as_one_graph_and_agree_with_eager_unpadded():
    # fullgraph=True: a graph break is an error. n=1 adds Dynamo's static graph.
    for seed in range(25):
        program, sizes = fuzz.generate(seed), fuzz.case_sizes(seed)
        setup = fuzz.Setup(padding=False)
        outcome = fuzz.run_case(program, sizes, setup)
        assert outcome.status == "ok", fuzz.reproducer(program, sizes, setup, outcome)
        assert outcome.graphs == 1 + (1 in sizes), seed


RETURNS_NOTHING = next(s for s in range(100) if fuzz.generate(s).returns == "nothing")


@pytest.mark.parametrize("full_graph, path, seed", [("off", "compiled", 3), ("pieces", "compiled", 3),
                                                     ("off", "breakable", 3), ("off", "compiled", RETURNS_NOTHING)])
def test_reproducer_runs_standalone(full_graph, path, seed):
    program = fuzz.generate(seed)
    script = fuzz.reproducer(program, (5, 2), fuzz.Setup(full_graph=full_graph, path=path, padding=None))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "class Model(torch.nn.Module)" in script
    assert ("torch.compile(model" in script) == (path == "compiled")
    assert ("GraphManager(model" in script) == (path == "breakable")
    assert ("capturable_split_ops" in script) == (full_graph != "off")


def test_shrinking_keeps_what_the_failure_needs():
    # A stand-in failure: any program that reduces over the capture dimension.
    def check(program: Program, sizes) -> fuzz.Outcome:
        return fuzz.Outcome("mismatch" if "reduce_rows" in program.productions else "ok", sizes[-1])

    programs = (fuzz.generate(s) for s in range(200))
    long_one = next(p for p in programs if "reduce_rows" in p.productions and len(p.steps) > 5)
    program, sizes = fuzz.shrink(long_one, (3, 5, 9), fuzz.Outcome("mismatch", 5), check)[:2]
    assert "reduce_rows" in program.productions
    # 1-minimal: dropping any step left drops the reduction too (it fed it).
    assert all("reduce_rows" not in program.without_step(i).productions for i in range(len(program.steps)))
    assert sizes == (5,)
    fuzz.load(program)  # still valid source


def test_compare_allows_reordering_and_catches_padding_errors():
    names = ["t", "i"]
    x = torch.randn(5, 8)
    ids = torch.arange(5)
    assert fuzz.compare((x * (1 + 1e-6), ids), (x, ids), names) is None
    assert "output i" in fuzz.compare((x, ids.flip(0)), (x, ids), names)
    assert "output t" in fuzz.compare((x - x.mean(0), ids), (x - torch.cat([x, torch.zeros(3, 8)]).mean(0), ids), names)
    nan = torch.tensor([float("nan"), 1.0])
    assert fuzz.compare((nan, ids), (nan.clone(), ids), names) is None
    assert fuzz.compare((torch.ones(2), ids), (nan, ids), names) is not None


def test_shapes_in_the_source_match_eager():
    # The shape comments are what a reader of a reproducer trusts.
    for seed in range(30):
        program = fuzz.generate(seed)
        model = fuzz.load(program)
        inputs = model["make_inputs"](6, "cpu")
        with torch.no_grad():
            outputs = model["Model"]()(*inputs)
        assert (outputs is None) == (program.returns == "nothing"), seed
        for var, value in zip(program.outputs, outputs or ()):
            expected = tuple(6 if d == N else d for d in var.shape)
            assert tuple(value.shape) == expected, (seed, var)
            assert (value.dtype == torch.int64) == var.is_index


# -- cgcompile against eager -----------------------------------------------------------------


def test_padded_on_cpu_eager_pieces_agree_with_eager():
    _assert_only_known_bugs(CPU_SEEDS, fuzz.Setup("eager", "cpu", padding=True))


def test_padded_on_cpu_inductor_pieces_agree_with_eager():
    _assert_only_known_bugs(CPU_INDUCTOR_SEEDS, fuzz.Setup("inductor", "cpu", padding=True))


def test_full_graphs_on_cpu_agree_with_eager():
    """Every split op declared capturable: calls of a capture size whose host-side inputs
    repeat take the full path, the others run piecewise, padded or not."""
    _assert_only_known_bugs(FULL_GRAPH_SEEDS, fuzz.Setup("eager", "cpu", padding=True, full_graph="pieces"))


FUSED_SEEDS = [s for s in range(400) if "sibling_linears" in fuzz.generate(s).productions][:24]


def test_fused_sibling_linears_on_cpu_agree_with_eager():
    """Config.fuse_sibling_linears on programs with sibling linears, piecewise and full."""
    setup = fuzz.Setup("eager", "cpu", padding=True, full_graph="pieces", fuse_sibling_linears=True)
    _assert_only_known_bugs(FUSED_SEEDS, setup)


def test_whole_graph_compiles_on_cpu_agree_with_eager():
    _assert_only_known_bugs(CPU_INDUCTOR_SEEDS, fuzz.Setup("inductor", "cpu", padding=True, full_graph="whole"))


def test_breakable_graphs_on_cpu_agree_with_eager():
    """The breakable path (op_replay segments), exact sizes, each size observed, captured
    and replayed, every call with its own data."""
    _assert_only_known_breakable_bugs(range(400), fuzz.Setup(device="cpu", padding=None, path="breakable"))


def _assert_only_known_breakable_bugs(seeds, setup: fuzz.Setup) -> None:
    known, new, _, _ = _fuzz(seeds, setup, bugs=BREAKABLE_KNOWN_BUGS)
    assert not new, f"{len(new)} failures outside BREAKABLE_KNOWN_BUGS; reproducers:\n\n" + "\n\n".join(new)
    if known:
        pytest.xfail(f"{len(known)} of {len(seeds)} cases fail, all through BREAKABLE_KNOWN_BUGS:\n" + "\n".join(known))


# Row-local programs whose split ops keep rows apart too (silly_pair's second result mixes
# rows): the programs for which Config(padding=True), the user's word, holds on the breakable path.
BREAKABLE_PADDED_SEEDS = [s for s in range(1200) if fuzz.generate(s).mode == "row_local"
                          and "split_pair" not in fuzz.generate(s).productions][:150]


def test_padded_breakable_graphs_on_cpu_agree_with_eager_where_rows_never_mix():
    _assert_only_known_breakable_bugs(BREAKABLE_PADDED_SEEDS, fuzz.Setup(device="cpu", padding=True, path="breakable"))


# Cases the GPU found, each with the Setup it failed under there. A split op wrote into a
# view of the input `out` (`out[:, 1:]`) that a captured piece had made of its static copy
# of `out`: at the n=1 call (a static graph, whose view of `out` was not eager by accident
# of a second size symbol) the write landed in the copy.
GPU_FOUND_THROUGH_GRAPHS = (
    (1326, fuzz.Setup("eager", "cpu", padding=True)),
    (3063, fuzz.Setup("eager", "cpu", padding=None, full_graph="pieces")),
    (5060, fuzz.Setup("eager", "cpu", padding=None, full_graph="pieces", fuse_sibling_linears=True)),
    (5213, fuzz.Setup("eager", "cpu", padding=None, full_graph="pieces", fuse_sibling_linears=True)),
)


@pytest.mark.parametrize("seed, setup", GPU_FOUND_THROUGH_GRAPHS, ids=[str(s) for s, _ in GPU_FOUND_THROUGH_GRAPHS])
def test_cases_the_gpu_found_agree_with_eager_through_fake_graphs(monkeypatch, seed, setup):
    """Through fake graphs (`fake_graphs.fake_cuda_graphs`), whose captured pieces read static
    copies of their inputs as real ones do; the CPU's padded pieces read the inputs."""
    fake_graphs.fake_cuda_graphs(monkeypatch)
    program, sizes = setup.case(seed)
    outcome = fuzz.run_case(program, sizes, setup)
    assert outcome.status == "ok", (outcome, fuzz.reproducer(program, sizes, setup, outcome))
    assert fake_graphs.FakeGraph.captures > 0  # the graphs ran, or this would check nothing


def _compiled_matches_eager_at_a_padded_size(make: Callable[[], Callable]) -> None:
    config = fuzz.Setup("eager", "cpu", padding=True).config()
    compiled = torch.compile(make(), backend=cgcompile.Backend(config), fullgraph=True)
    x = torch.randn(3, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch.testing.assert_close(compiled(x), make()(x))


def _models(bugs) -> list:
    return [pytest.param(make, id=f"bug{i}-{j}") for i, bug in enumerate(bugs) for j, make in enumerate(bug.models)]


@pytest.mark.parametrize("make", _models(KNOWN_BUGS))
@pytest.mark.xfail(strict=True, reason="a known bug (KNOWN_BUGS); this passes, and so fails, once it is fixed")
def test_known_bug_reproduces(make):
    _compiled_matches_eager_at_a_padded_size(make)


@pytest.mark.parametrize("make", _models(FIXED_BUGS))
def test_fixed_bug_stays_fixed(make):
    _compiled_matches_eager_at_a_padded_size(make)


@pytest.mark.parametrize("make", _models(BREAKABLE_KNOWN_BUGS))
@pytest.mark.xfail(strict=True, reason="a known bug (BREAKABLE_KNOWN_BUGS); this passes, and so fails, once fixed")
def test_known_breakable_bug_reproduces(make):
    _breakable_matches_eager_over_observe_capture_replay(make)


@pytest.mark.parametrize("make", _models(BREAKABLE_FIXED_BUGS))
def test_fixed_breakable_bug_stays_fixed(make):
    _breakable_matches_eager_over_observe_capture_replay(make)


def _breakable_matches_eager_over_observe_capture_replay(make: Callable[[], torch.nn.Module]) -> None:
    config = fuzz.Setup(device="cpu", padding=None, path="breakable").config()
    model, reference = make(), make()
    manager = cgcompile.GraphManager(model, config, boundary=None, segments="op_replay")
    with torch.no_grad():
        for call in range(3):  # observe, capture, replay
            x, out, want = torch.randn(3, 8) * (call + 1), torch.ones(3, 8), torch.ones(3, 8)
            for t in (x, out):
                torch._dynamo.mark_dynamic(t, 0)
            manager.run_pw_graph(model, (x, out))
            reference(x, want)
            torch.testing.assert_close(out, want)


def test_a_cached_inductor_piece_keeps_its_guards():
    """The compile at n=2 specialises the capture size (one row left of x[1:]). Marked
    dynamic, that raises ConstraintViolationError, as torch.compile does; the same piece
    served from Inductor's caches must add the same guard and raise too, not run at n=3
    and fail Inductor's size assertion."""
    edge = torch.randn(1, 8)

    def shift(x):  # x: [n, 8]
        return torch.cat([x[1:], edge], dim=0) * 2.0

    with fresh_inductor_cache():
        for _source in ("compiled", "from the cache"):
            torch._dynamo.reset()
            counters.clear()
            config = cgcompile.Config(compiler="inductor", capture_sizes=(1, 2, 4, 8))
            compiled = torch.compile(shift, backend=cgcompile.Backend(config), fullgraph=True)
            for n in (2, 3):
                x = torch.randn(n, 8)
                torch._dynamo.mark_dynamic(x, 0)
                if n == 2:
                    with pytest.raises(ConstraintViolationError):
                        compiled(x)
                else:
                    torch.testing.assert_close(compiled(x), shift(x))
    assert counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"] >= 2


@pytest.mark.cuda
def test_cuda_graphs_eager_pieces_agree_with_eager():
    _assert_only_known_bugs(GPU_SEEDS, fuzz.Setup("eager", "cuda", padding=None))


@pytest.mark.cuda
def test_cuda_graphs_inductor_pieces_agree_with_eager():
    _assert_only_known_bugs(GPU_INDUCTOR_SEEDS, fuzz.Setup("inductor", "cuda", padding=None))


@pytest.mark.cuda
def test_cuda_full_graphs_agree_with_eager():
    _assert_only_known_bugs(range(0, 1000, 4), fuzz.Setup("eager", "cuda", padding=None, full_graph="pieces"))


@pytest.mark.cuda
def test_cuda_fused_sibling_linears_agree_with_eager():
    fused = [s for s in range(2000) if "sibling_linears" in fuzz.generate(s).productions][:100]
    _assert_only_known_bugs(fused, fuzz.Setup("eager", "cuda", padding=None, full_graph="pieces",
                                              fuse_sibling_linears=True))


@pytest.mark.cuda
def test_cuda_breakable_graphs_agree_with_eager():
    _assert_only_known_breakable_bugs(range(0, 1000, 2), fuzz.Setup(device="cuda", padding=None, path="breakable"))


@pytest.mark.cuda
def test_cuda_whole_graph_compiles_agree_with_eager():
    _assert_only_known_bugs(range(0, 1000, 50), fuzz.Setup("inductor", "cuda", padding=None, full_graph="whole"))


def test_inductor_walks_of_a_token_shift_never_take_n_2():
    """torch.compile rejects n=2 for a marked-dynamic dim that a program slices a row off
    under AOTAutograd (seed 4003 on the GPU: "invalid", torch.compile rejects it too)."""
    inductor, eager = fuzz.Setup(compiler="inductor"), fuzz.Setup(compiler="eager")
    shifted = [seed for seed in range(300) if "shift_rows" in fuzz.generate(seed).productions]
    assert any(2 in eager.case(seed)[1] for seed in shifted)
    assert all(2 not in inductor.case(seed)[1] for seed in shifted)
    assert inductor.case(4003)[1] == (6, 16, 4, 6)
