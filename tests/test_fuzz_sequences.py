"""The fuzzer's sequence mode (`Setup(sequence=...)`, `--sequence`): walks of sizes that
return to earlier ones, and programs that keep state in attributes across calls, as a
serving model keeps a sliding-window KV cache. On the CPU with padding=True, so the padded
path runs; the GPU run is benchmarks/gpu_verify.sh's `fuzz_sequence` jobs."""

import functools
import subprocess
import sys

import torch

from cgcompile.testing import fuzz
from cgcompile.testing.grammar import MODES, N

STATE = {p.name for p in fuzz.PRODUCTIONS if p.family == "state"}
SEQUENCE = fuzz.Setup("eager", "cpu", padding=True, sequence=fuzz.SEQUENCE_LENGTH)


def _has_return(sizes) -> bool:
    """Some size comes back after another size ran in between."""
    return any(n in sizes[:i - 1] and sizes[i - 1] != n for i, n in enumerate(sizes) if i > 1)


# -- the sizes -------------------------------------------------------------------------------


def test_walks_return_to_sizes_and_mix_every_kind():
    walks = [fuzz.sequence_sizes(seed) for seed in range(100)]
    for sizes in walks:
        assert len(sizes) == fuzz.SEQUENCE_LENGTH and len(set(sizes)) < len(sizes)
        assert 1 in sizes  # Dynamo's static graph of its own
        assert set(sizes) & {2, 4, 8}  # a capture size
        assert set(sizes) & {3, 5, 6, 7}  # one between capture sizes
        assert [n for n in sizes if n > max(fuzz.CAPTURE_SIZES)]
        assert [n for n in sizes if n > 1][0] != 2  # see case_sizes
    assert sum(map(_has_return, walks)) > 90
    assert any(a == b for sizes in walks for a, b in zip(sizes, sizes[1:]))  # a size called twice in a row
    assert all(len(set(fuzz.sequence_sizes(seed, 3))) < 3 for seed in range(50))  # short walks still return


def test_default_sizes_return_to_one_size_after_the_others():
    for seed in range(50):
        sizes = fuzz.case_sizes(seed)
        assert sizes[-1] in sizes[:-2]  # not a repeat of the size before it
        assert len(set(sizes)) == len(sizes) - 1


def test_a_seed_reproduces_its_walk_and_program():
    assert fuzz.sequence_sizes(7) == fuzz.sequence_sizes(7)
    assert fuzz.sequence_sizes(7) != fuzz.sequence_sizes(8)
    assert fuzz.source(SEQUENCE.case(7)[0]) == fuzz.source(SEQUENCE.case(7)[0])
    program, sizes = SEQUENCE.case(7)
    script = fuzz.reproducer(program, sizes, SEQUENCE)
    assert f"# sizes, in order: {sizes}" in script
    assert f"--sequence {fuzz.SEQUENCE_LENGTH}" in script


# -- the stateful productions ----------------------------------------------------------------


def test_stateful_programs_reach_every_state_production():
    programs = [fuzz.generate(seed, stateful=True) for seed in range(200)]
    assert all(STATE & set(p.productions) for p in programs)  # one forced in each
    assert {name for p in programs for name in p.productions} >= STATE
    assert {p.mode for p in programs} == set(MODES)
    mixing = {p.name for p in fuzz.PRODUCTIONS if p.mixes_rows}
    for p in programs:  # row-local programs keep state whose rows stay apart
        assert p.mode != "row_local" or not mixing & set(p.productions)
    assert not any(STATE & set(fuzz.generate(seed).productions) for seed in range(200))


def test_state_is_a_view_kept_in_a_plain_attribute_and_read_by_the_next_call():
    program = next(p for p in (fuzz.generate(s, stateful=True) for s in range(100)) if p.row_states)
    namespace = fuzz.load(program)
    model = namespace["Model"]()
    name = program.row_states[0]
    assert getattr(model, name) is None and name not in dict(model.named_buffers())
    with torch.no_grad():
        first = model(*namespace["make_inputs"](3, "cpu"))
        state = getattr(model, name)
        assert state.shape[0] == 3 and state._base is not None  # a view of what the call made
        again = model(*namespace["make_inputs"](3, "cpu"))
        assert any(not torch.equal(a, b) for a, b in zip(first, again))  # the same inputs, another state
        model(*namespace["make_inputs"](5, "cpu"))
        assert getattr(model, name).shape[0] == 5  # a new batch: it starts over
    for var in program.outputs:  # shape comments hold
        assert all(isinstance(d, int) or d == N for d in var.shape)


def _differs_once_kept_state_is_overwritten(program, sizes) -> bool:
    """Whether the walk shows it when, after each call, the memory the state kept is
    written (what a graph that reuses that pool memory would do)."""
    namespace = fuzz.load(program)
    reference, model = namespace["Model"](), namespace["Model"]()
    states = [p.name for step in program.steps for p in step.params if p.kind in ("state", "row_state")]
    with torch.no_grad():
        for n in sizes:
            inputs = namespace["make_inputs"](n, "cpu")
            if fuzz.error(model(*inputs), reference(*inputs)) > 1:
                return True
            for name in states:
                getattr(model, name).add_(1.0)  # through the view, into the memory it keeps
    return False


def test_state_overwritten_between_calls_shows_as_a_mismatch():
    cases = [SEQUENCE.case(seed) for seed in range(20)]
    assert sum(_differs_once_kept_state_is_overwritten(*case) for case in cases) >= 16


def test_reproducer_of_a_stateful_case_runs_standalone():
    program, sizes = next((p, s) for p, s in map(SEQUENCE.case, range(100)) if p.row_states)
    script = fuzz.reproducer(program, sizes, SEQUENCE)
    assert "mark_state(model)" in script
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_shrinking_a_walk_keeps_the_return():
    # A stand-in failure: any call of a size that ran before, with another size in between.
    def check(program, sizes) -> fuzz.Outcome:
        for i, n in enumerate(sizes):
            if i > 1 and n in sizes[:i - 1] and sizes[i - 1] != n:
                return fuzz.Outcome("mismatch", n, position=i)
        return fuzz.Outcome("ok")

    program = fuzz.generate(3, stateful=True)
    sizes = (3, 16, 1, 8, 3, 8)
    program, sizes, outcome = fuzz.shrink(program, sizes, check(program, sizes), check)
    assert sizes == (3, 8, 3) and outcome.position == 2


# -- cgcompile against eager -----------------------------------------------------------------


def test_padded_on_cpu_eager_pieces_agree_with_eager_over_walks_with_state():
    padded, new = 0, []
    for seed in range(24):
        program, sizes = SEQUENCE.case(seed)
        outcome = fuzz.run_case(program, sizes, SEQUENCE)
        padded += outcome.padded
        if outcome.status in fuzz.FAILURES:
            check = functools.partial(fuzz.run_case, setup=SEQUENCE)
            program, sizes, outcome = fuzz.shrink(program, sizes, outcome, check, budget_s=30)
            new.append(fuzz.reproducer(program, sizes, SEQUENCE, outcome))
    assert not new, f"{len(new)} failures; reproducers:\n\n" + "\n\n".join(new)
    assert padded >= 3, f"only {padded} cases ran padded"


def test_programs_that_write_into_an_input_agree_with_eager_over_walks():
    """The sink productions (a write into an input, maybe nothing returned) come with the
    programs without state; walked over returning sizes, each call's write must match."""
    seeds = [s for s in range(300) if fuzz.generate(s).written_inputs][:10]
    for seed in seeds:
        program, sizes = fuzz.generate(seed), fuzz.sequence_sizes(seed)
        outcome = fuzz.run_case(program, sizes, SEQUENCE)
        assert outcome.status == "ok", fuzz.reproducer(program, sizes, SEQUENCE, outcome)
    assert len(seeds) == 10
