"""The fuzzer's programs: random models written as Python source, from a grammar of
the ops real models use (`PRODUCTIONS`), each production a small function.

A `Program` is straight-line code over tensors whose shapes are known symbolically
(`N` marks the capture dimension, always dim 0). `generate(seed)` grows one with
`_Builder`: each step picks a production by weight, the production picks the tensors
it needs (`_Builder.pick`, preferring recent ones so programs form chains), emits its
lines and defines new tensors, or raises `Skip` when nothing fits. `source(program)`
renders the module `cgcompile.fuzz` executes and prints as a reproducer.

The rules that keep eager's answer well defined, so any difference is cgcompile's:
  - no ties where order matters: inputs and parameters are random floats, sorts are
    stable and argmax returns the first maximum everywhere; topk returns values only;
  - nothing Dynamo cannot trace as one graph (indexing by a 0-d tensor, a slice of
    n // 2 rows, which specializes), so that every case compiles one graph per kind of n;
  - in-place writes only into intermediates, never into an input or parameter (or a
    view of one), never through a tensor a `reshape` may or may not alias
    (`_Builder.mutate`), and never with an operand that aliases the target. The one
    exception is an input made to be written: see below.

Programs whose effect is a write into an input (the "sink" productions, drawn after
every other step of some programs without state): a tensor is accumulated into `out`, an input
of its own, through a split op, as an attention op writes the output buffer it is handed.
Such a program returns nothing (`return ()`, or no return at all: Dynamo's graph then has
no outputs) or its outputs besides (`Program.returns`); the fuzzer compares the inputs it
writes after each call (`Program.written_inputs`), as it compares outputs.

State kept across calls (`generate(seed, stateful=True)`, the fuzzer's sequence mode):
the "state" productions keep a tensor the call made, a view of an intermediate, in a
plain attribute of the model (not a buffer), and the next call reads it, as a serving
model keeps a sliding-window KV cache. A state's shape either does not depend on n, or
the state starts over when n changes (its dim 0 then is the capture dimension, marked
dynamic before each call by the source's `mark_state`, as the inputs are).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Callable, Sequence

N = "n"  # the capture dimension in a `Var`'s shape
DIMS = (8, 12, 16, 24, 32)
MAX_DIM = 48


# -- the program ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Var:
    """A tensor of the program. shape: ints and N; bound: index values lie in [0, bound)."""

    name: str
    shape: tuple[int | str, ...]
    base: str  # the tensor whose storage it views: its own name when fresh
    bound: int | str | None = None  # set for index (int64) tensors only
    dtype: str = "float32"  # of a tensor that is not an index: float32, float64 or bool

    @property
    def is_index(self) -> bool:
        return self.bound is not None

    @property
    def rows(self) -> bool:
        """Dim 0 is the capture dimension."""
        return bool(self.shape) and self.shape[0] == N

    def __str__(self) -> str:
        return self.name


PARAM_KINDS = ("parameter", "buffer", "state", "row_state")


@dataclasses.dataclass(frozen=True)
class Param:
    """A parameter; a buffer (state the model writes into, as a KV cache); or state: a
    plain attribute, None until forward sets it to a tensor it made, which the next call
    reads ("row_state": its dim 0 is the capture dimension)."""

    name: str
    init: str  # an expression over `g`, the model's seeded generator
    kind: str = "parameter"  # one of PARAM_KINDS

    def source(self) -> str:
        if self.kind == "buffer":
            return f'self.register_buffer("{self.name}", {self.init})'
        if self.kind in ("state", "row_state"):
            return f"self.{self.name} = None  # kept across calls: forward sets it"
        return f"self.{self.name} = torch.nn.Parameter({self.init})"


@dataclasses.dataclass(frozen=True)
class Step:
    """What one production emitted: source lines and the tensors they read and write."""

    production: str
    lines: tuple[str, ...]
    reads: frozenset[str]
    mutates: frozenset[str]  # bases written in place
    defines: tuple[Var, ...]
    params: tuple[Param, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    seed: int
    inputs: tuple[Var, ...]  # x first: the capture dimension is its dim 0
    steps: tuple[Step, ...]
    mode: str = "any"  # which productions it drew from (`MODES`)
    layout: str = "contiguous"  # of the float inputs (`LAYOUTS`)
    inference_mode: bool = False  # run under torch.inference_mode(), else torch.no_grad()
    stateful: bool = False  # drawn with the "state" productions (`generate`)
    returns: str = "outputs"  # what forward returns (`RETURNS`)

    @property
    def productions(self) -> tuple[str, ...]:
        return tuple(step.production for step in self.steps)

    @property
    def row_states(self) -> tuple[str, ...]:
        """The state attributes whose dim 0 is the capture dimension."""
        return tuple(p.name for s in self.steps for p in s.params if p.kind == "row_state")

    @property
    def outputs(self) -> tuple[Var, ...]:
        """Every tensor that no step reads after its last write (its definition or an
        in-place write into its storage): so every step's work reaches an output. Empty
        where the program returns nothing."""
        if self.returns != "outputs":
            return ()

        def last(v: Var, touches: Callable[[Step], bool]) -> int:
            return max((i for i, s in enumerate(self.steps) if touches(s)), default=-1)

        defined = [v for s in self.steps for v in s.defines]
        return tuple(
            v for v in defined
            if last(v, lambda s: v.name in s.reads) <= last(v, lambda s: v in s.defines or v.base in s.mutates)
        )

    def without_step(self, index: int) -> "Program":
        """The program without step `index` and every step that reads what it defined."""
        dropped = {v.name for v in self.steps[index].defines}
        kept = []
        for i, step in enumerate(self.steps):
            if i == index or step.reads & dropped:
                dropped |= {v.name for v in step.defines}
                continue
            kept.append(step)
        return dataclasses.replace(self, steps=tuple(kept))

    def used_inputs(self) -> tuple[Var, ...]:
        read = set().union(*(s.reads for s in self.steps))
        return tuple(v for i, v in enumerate(self.inputs) if i == 0 or v.name in read)

    @property
    def written_inputs(self) -> tuple[Var, ...]:
        """The inputs a call writes into (the sink productions'), in the signature's order."""
        written = set().union(*(s.mutates for s in self.steps))
        return tuple(v for v in self.used_inputs() if v.base in written)


# -- building a program: the builder the productions call ------------------------------------


class Skip(Exception):
    """A production does not apply to the program as it stands."""


class _Builder:
    """Grows one program. A production picks tensors, defines new ones and emits lines;
    `run` commits its step, or discards it if the production raised `Skip`."""

    def __init__(self, rng: random.Random, inputs: Sequence[Var]):
        self.rng = rng
        self.vars: list[Var] = list(inputs)
        self.new_inputs: list[Var] = []  # inputs made to be written (`input_to_write`)
        self.steps: list[Step] = []
        self.immutable = {v.base for v in inputs}
        self.ambiguous: set[str] = set()  # bases a reshape may or may not alias
        self._names = itertools.count()
        self._begin()

    def run(self, name: str, fn: Callable[["_Builder"], None]) -> bool:
        self._begin()
        try:
            fn(self)
        except Skip:
            return False
        self.vars += self._defines
        self.new_inputs += self._new_inputs
        self.ambiguous |= self._ambiguous
        self.steps.append(Step(name, tuple(self._lines), frozenset(self._reads), frozenset(self._mutates),
                               tuple(self._defines), tuple(self._params)))
        return True

    def _begin(self) -> None:
        """Start a step: what the production in progress has emitted so far."""
        self._lines, self._defines, self._params, self._new_inputs = [], [], [], []
        self._reads, self._mutates, self._ambiguous = set(), set(), set()

    # -- for productions ------------------------------------------------------------------

    def choice(self, options):
        return self.rng.choice(list(options))

    def pick(self, accept: Callable[[Var], bool] = lambda v: True, *, index: bool = False,
             dtype: str = "float32") -> Var:
        """A tensor that `accept`s, preferring recent ones (so programs form chains): an
        index tensor, or one of `dtype` (float32 unless a production asks otherwise)."""
        pool = [v for v in self.vars + self._defines
                if v.is_index == index and (index or v.dtype == dtype) and accept(v)]
        if not pool:
            raise Skip
        var = self.rng.choices(pool, weights=[(i + 1) ** 2 for i in range(len(pool))])[0]
        self._reads.add(var.name)
        return var

    def param(self, init: str, *, buffer: bool = False) -> str:
        name = f"{'b' if buffer else 'p'}{next(self._names)}"
        self._params.append(Param(name, init, "buffer" if buffer else "parameter"))
        return f"self.{name}"

    def state(self, *, rows: bool) -> str:
        """A plain attribute kept across calls, None before the first; rows: its dim 0
        is the capture dimension (so it must start over when n changes)."""
        name = f"s{next(self._names)}"
        self._params.append(Param(name, "None", "row_state" if rows else "state"))
        return f"self.{name}"

    def define(self, expr: str, shape, *, bound=None, dtype="float32", view_of: Var | None = None,
               ambiguous=False) -> Var:
        return self.define_many(expr, [(shape, bound)], dtype=dtype, view_of=view_of, ambiguous=ambiguous)[0]

    def define_many(self, expr: str, specs, *, dtype="float32", view_of: Var | None = None,
                    ambiguous=False) -> list[Var]:
        """`a, b = expr`, each spec a (shape, bound); outputs view `view_of` if given."""
        out = []
        for shape, bound in specs:
            if any(isinstance(d, int) and d > MAX_DIM for d in shape):
                raise Skip
            name = f"{'i' if bound is not None else 't'}{next(self._names)}"
            out.append(Var(name, tuple(shape), view_of.base if view_of else name, bound, dtype))
        if ambiguous:
            self._ambiguous.add(view_of.base)
        comment = ", ".join(_describe(v) for v in out)
        self._lines.append(f"{', '.join(v.name for v in out)} = {expr}  # {comment}")
        self._defines += out
        return out

    def write_state(self, line: str) -> None:
        """Emit a write into the model's own state (a buffer or an attribute), not into
        a program tensor."""
        self._lines.append(line)

    def mutate(self, var: Var, line: str) -> None:
        """Emit an in-place write into `var`. Allowed only where eager's answer is defined:
        not into an input (or a view of one), not where a reshape may or may not alias."""
        if var.is_index or var.base in self.immutable or var.base in self.ambiguous | self._ambiguous:
            raise Skip
        self._mutates.add(var.base)
        self._reads.add(var.name)
        self._lines.append(line)

    def input_to_write(self, shape) -> Var:
        """A new float input, `out`, that the program may write into (`write_input`).
        Writing into it keeps eager's answer defined: no other step reads it."""
        var = Var("out", tuple(shape), "out")
        if not var.rows or any(v.name == var.name for v in self.vars + self.new_inputs):
            raise Skip
        self._new_inputs.append(var)
        return var

    def write_input(self, var: Var, line: str) -> None:
        """Emit an in-place write into an input made by `input_to_write`."""
        assert var in self._new_inputs, var
        self._mutates.add(var.base)
        self._reads.add(var.name)
        self._lines.append(line)


def _describe(var: Var) -> str:
    shape = "[" + ", ".join(map(str, var.shape)) + "]"
    if var.is_index:
        return f"{shape} int < {var.bound}"
    return shape if var.dtype == "float32" else f"{shape} {var.dtype}"


# -- the grammar -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Production:
    """name: the function's; family: what kind of op (split productions may be forced at
    a program's start and end); mixes_rows: some form of it lets a row's result depend
    on other rows along the capture dimension, or on their number."""

    name: str
    family: str
    weight: float
    mixes_rows: bool
    emit: Callable[[_Builder], None]


PRODUCTIONS: list[Production] = []


def production(family: str, weight: float = 1.0, mixes_rows: bool = False):
    def register(fn):
        PRODUCTIONS.append(Production(fn.__name__, family, weight, mixes_rows, fn))
        return fn
    return register


def _nd(*ranks: int) -> Callable[[Var], bool]:
    return lambda v: len(v.shape) in ranks


def _rows(*ranks: int) -> Callable[[Var], bool]:
    return lambda v: v.rows and (not ranks or len(v.shape) in ranks)


def _int_last(v: Var) -> bool:
    """The last dimension is a fixed size, not the capture dimension: parameters can be
    shaped to it, and an op along it keeps rows apart."""
    return bool(v.shape) and isinstance(v.shape[-1], int)


def _same_shape(a: Var) -> Callable[[Var], bool]:
    return lambda v: v.shape == a.shape


def _vector(dim: int) -> str:
    return f"torch.randn({dim}, generator=g) * 0.1"


# elementwise


@production("elementwise")
def unary(g):
    v = g.pick()
    fn = g.choice(["torch.sin", "torch.relu", "F.silu", "torch.tanh", "torch.sigmoid"])
    g.define(f"{fn}({v})", v.shape)


@production("elementwise")
def scale_shift(g):
    v = g.pick(_int_last)
    d = v.shape[-1]
    if g.rng.random() < 0.5:
        g.define(f"{v} * {g.param(f'1 + {_vector(d)}')} + {g.param(_vector(d))}", v.shape)
    else:
        g.define(f"{v} * {g.choice(['0.5', '-1.5', '2.0'])} + {g.choice(['0.25', '1.0', '-0.5'])}", v.shape)


def _broadcasts_into(a: Var) -> Callable[[Var], bool]:
    """b's shape broadcasts to a's without growing a: equal, or a row-free suffix."""
    def accept(b):
        if b.shape == a.shape:
            return True
        if N in b.shape or len(b.shape) > len(a.shape):
            return False
        tail = a.shape[len(a.shape) - len(b.shape):]
        return all(db in (1, da) for db, da in zip(b.shape, tail))
    return accept


@production("elementwise", weight=2)
def binary(g):
    a = g.pick()
    b = g.pick(_broadcasts_into(a))
    g.define(f"{a} {g.choice('+-*')} {b}", a.shape)


@production("elementwise")
def where(g):
    a = g.pick()
    b = g.pick(_same_shape(a))
    g.define(f"torch.where({a} > 0, {a}, {b} * 0.5)", a.shape)


@production("elementwise")
def clamp(g):
    v = g.pick()
    g.define(f"{v}.clamp({g.choice(['-0.5, 0.5', 'min=-1.0', 'max=0.75'])})", v.shape)


@production("elementwise")
def rms_norm(g):
    v = g.pick(_int_last)
    g.define(f"{v} * torch.rsqrt({v}.pow(2).mean(-1, keepdim=True) + 1e-6)", v.shape)


@production("elementwise")
def layer_norm(g):
    v = g.pick(_int_last)
    d = v.shape[-1]
    weight = g.choice(["", f", {g.param(f'1 + {_vector(d)}')}"])
    g.define(f"F.layer_norm({v}, ({d},){weight})", v.shape)


# other dtypes: float64 and bool tensors, which may cross piece boundaries too


@production("dtype")
def to_double(g):
    v = g.pick()
    g.define(g.choice([f"{v}.double()", f"{v}.to(torch.float64)"]), v.shape, dtype="float64")


@production("dtype", weight=8)
def from_double(g):
    v = g.pick(dtype="float64")
    g.define(g.choice([f"({v} * 1.25).float()", f"torch.tanh({v}).to(torch.float32)"]), v.shape)


@production("dtype")
def mask(g):
    v = g.pick()
    g.define(f"{v} > {g.choice(['0', '0.5'])}", v.shape, dtype="bool")


@production("dtype", weight=8)
def apply_mask(g):
    m = g.pick(dtype="bool")
    v = g.pick(_same_shape(m))
    g.define(g.choice([f"torch.where({m}, {v}, 0.0)", f"{v}.masked_fill({m}, -1.0)", f"{v} * {m}"]), v.shape)


# views of dimensions other than the capture dimension


def _factor(d: int, rng) -> tuple[int, int] | None:
    pairs = [(a, d // a) for a in range(2, d) if d % a == 0]
    return rng.choice(pairs) if pairs else None


@production("view")
def unflatten(g):
    v = g.pick(_rows(2))
    pair = _factor(v.shape[1], g.rng)
    if pair is None:
        raise Skip
    a, b = pair
    form = g.choice([f"{v}.unflatten(-1, ({a}, {b}))", f"{v}.view(-1, {a}, {b})",
                     f"{v}.reshape({v}.shape[0], {a}, {b})"])
    g.define(form, (N, a, b), view_of=v, ambiguous="reshape" in form)


@production("view", weight=3)
def transpose(g):
    v = g.pick(lambda v: len(v.shape) == 3 and v.rows or len(v.shape) == 2 and not v.rows)
    if v.rows:
        g.define(g.choice([f"{v}.transpose(1, 2)", f"{v}.permute(0, 2, 1)"]), (N, v.shape[2], v.shape[1]), view_of=v)
    else:
        g.define(f"{v}.t()", v.shape[::-1], view_of=v)


@production("view", weight=4)
def flatten(g):
    v = g.pick(_rows(3))
    form = g.choice([f"{v}.flatten(1)", f"{v}.reshape({v}.shape[0], -1)", f"{v}.flatten(-2)"])
    g.define(form, (N, v.shape[1] * v.shape[2]), view_of=v, ambiguous=True)


@production("view")
def unsqueeze(g):
    v = g.pick(_rows(2))
    g.define(g.choice([f"{v}.unsqueeze(1)", f"{v}[:, None]"]), (N, 1, v.shape[1]), view_of=v)


@production("view")
def regroup_rows(g):
    """Rows regrouped into more, shorter rows and back: [n, d] -> [n * d / b, b] -> [n, d]."""
    v = g.pick(_rows(2))
    pair = _factor(v.shape[1], g.rng)
    if pair is None:
        raise Skip
    op = g.choice(["torch.softmax({}, dim=-1)", "{} * 2.0", "{}.cumsum(-1)"])
    g.define(f"({op.format(f'{v}.reshape(-1, {pair[1]})')}).reshape({v}.shape)", v.shape)


@production("view", mixes_rows=True)
def flatten_rows(g):
    """The capture dimension flattened with the others, an op over the whole, and back."""
    v = g.pick(_rows())
    op = g.choice(["torch.softmax({}, dim=0)", "{}.cumsum(0)", "{} - {}.mean()"])
    flat = f"{v}.reshape(-1)"
    g.define(f"({op.format(flat, flat)}).view_as({v})", v.shape)


# matmul


@production("matmul", weight=2)
def linear(g):
    v = g.pick(_int_last)
    d, e = v.shape[-1], g.choice(DIMS[:4])
    if g.rng.random() < 0.5:
        w = g.param(f"torch.randn({d}, {e}, generator=g) / {math.sqrt(d):.4f}")
        g.define(f"{v} @ {w}", v.shape[:-1] + (e,))
    else:
        w = g.param(f"torch.randn({e}, {d}, generator=g) / {math.sqrt(d):.4f}")
        bias = g.param(_vector(e)) if g.rng.random() < 0.5 else "None"
        g.define(f"F.linear({v}, {w}, {bias})", v.shape[:-1] + (e,))


@production("matmul", weight=1)
def sibling_linears(g):
    """Two or three linears of one input, like q/k/v projections (what
    Config.fuse_sibling_linears fuses): biases on all, on none, or on the first only."""
    v = g.pick(_int_last)
    d = v.shape[-1]
    biases = g.choice(["all", "none", "first"])
    for k in range(g.choice([2, 3])):
        e = g.choice(DIMS[:4])
        w = g.param(f"torch.randn({e}, {d}, generator=g) / {math.sqrt(d):.4f}")
        bias = g.param(_vector(e)) if biases == "all" or (biases == "first" and k == 0) else "None"
        g.define(f"F.linear({v}, {w}, {bias})", v.shape[:-1] + (e,))


@production("matmul", weight=4)
def matmul_matrix(g):
    m = g.pick(lambda v: len(v.shape) == 2 and not v.rows)
    v = g.pick(lambda v: len(v.shape) >= 1 and v.shape[-1] == m.shape[0])
    g.define(f"{v} @ {m} / {m.shape[0]}", v.shape[:-1] + (m.shape[1],))


@production("matmul", mixes_rows=True)
def gram(g):
    """A matmul that contracts the capture dimension: [n, d1]^T @ [n, d2] -> [d1, d2]."""
    a = g.pick(_rows(2))
    b = g.pick(_rows(2))
    form = g.choice([f"{a}.t() @ {b}", f"{a}.transpose(0, 1) @ {b}", f"torch.mm({a}.T, {b})",
                     f"torch.einsum('nd,ne->de', {a}, {b})"])
    g.define(f"{form} / 16", (a.shape[1], b.shape[1]))


@production("matmul", mixes_rows=True)
def manual_attention(g):
    """Attention written out, not split: scores [n, n] mix rows."""
    q = g.pick(_rows(2))
    k = g.pick(lambda v: _rows(2)(v) and v.shape == q.shape)
    v = g.pick(_rows(2))
    scale = 1 / math.sqrt(q.shape[1])
    g.define(f"torch.softmax({q} @ {k}.t() * {scale:.4f}, dim=-1) @ {v}", v.shape)


@production("matmul", mixes_rows=True)
def conv_rows(g):
    """A depthwise convolution along the tokens (as Mamba's), each row seeing its neighbours."""
    v = g.pick(_rows(2))
    d = v.shape[1]
    w = g.param(f"torch.randn({d}, 1, 3, generator=g) / 3")
    g.define(f"F.conv1d({v}.t().unsqueeze(0), {w}, padding=1, groups={d}).squeeze(0).t()", v.shape)


# reductions


_REDUCTIONS = {
    "sum": "{v}.sum({dims}, keepdim={k})",
    "mean": "{v}.mean({dims}, keepdim={k})",
    "amax": "{v}.amax({dims}, keepdim={k})",
    "var": "{v}.var({dims}, keepdim={k})",
    "var0": "{v}.var({dims}, keepdim={k}, correction=0)",
    "logsumexp": "torch.logsumexp({v}, {dims}, keepdim={k})",
}


def _reduce(g, v: Var, dims: tuple[int, ...]) -> None:
    keep = g.rng.random() < 0.5
    form = _REDUCTIONS[g.choice(_REDUCTIONS)]
    dims_text = str(dims[0]) if len(dims) == 1 else str(dims)
    wanted = {d % len(v.shape) for d in dims}
    shape = tuple(1 if i in wanted else s for i, s in enumerate(v.shape) if keep or i not in wanted)
    g.define(form.format(v=v, dims=dims_text, k=keep), shape)


@production("reduction", mixes_rows=True)
def reduce_rows(g):
    _reduce(g, g.pick(_rows()), (0,))


@production("reduction")
def reduce_cols(g):
    _reduce(g, g.pick(_int_last), (-1,))


@production("reduction", mixes_rows=True)
def reduce_multi(g):
    v = g.pick(_nd(2, 3))
    options = [(0, 1), (0, -1), (-1, -2)] + ([(1, 2), (0, 1, 2)] if len(v.shape) == 3 else [])
    _reduce(g, v, g.choice(options))


@production("reduction", mixes_rows=True)
def norm_rows(g):
    """Statistics over the batch: batch norm in training mode, normalizing over dim 0."""
    v = g.pick(lambda v: v.rows and (len(v.shape) == 2 or len(v.shape) == 3 and v.shape[2] > 1))
    forms = [f"F.normalize({v}, dim=0)"]
    if len(v.shape) == 3:
        forms.append(f"F.batch_norm({v}, None, None, training=True)")
    g.define(g.choice(forms), v.shape)


@production("reduction", mixes_rows=True)
def max_rows(g):
    v = g.pick(_rows())
    fn = g.choice(["torch.max", "torch.min", "torch.median"])
    g.define_many(f"{fn}({v}, dim=0)", [(v.shape[1:], None), (v.shape[1:], N)])


# softmax and scans


@production("softmax")
def softmax_cols(g):
    v = g.pick(_int_last)
    g.define(g.choice([f"torch.softmax({v}, dim=-1)", f"F.log_softmax({v}, dim=-1)"]), v.shape)


@production("softmax", mixes_rows=True)
def softmax_rows(g):
    v = g.pick(_rows())
    forms = [f"torch.softmax({v}, dim=0)", f"F.log_softmax({v}, dim=0)"]
    if len(v.shape) == 2:
        forms.append(f"torch.softmax({v}.t(), dim=-1).t()")
    g.define(g.choice(forms), v.shape)


@production("scan", mixes_rows=True)
def cumsum_rows(g):
    v = g.pick(_rows())
    g.define(g.choice([f"{v}.cumsum(0)", f"torch.cumsum({v}, dim=0)"]), v.shape)


@production("scan")
def cumsum_cols(g):
    v = g.pick(_int_last)
    g.define(f"{v}.cumsum(-1)", v.shape)


# order: sort, topk, argmax


@production("order")
def sort_cols(g):
    v = g.pick(_int_last)
    descending = g.choice(["", ", descending=True"])
    g.define_many(f"torch.sort({v}, dim=-1, stable=True{descending})", [(v.shape, None), (v.shape, v.shape[-1])])


@production("order", mixes_rows=True)
def sort_rows(g):
    v = g.pick(_rows())
    g.define_many(f"torch.sort({v}, dim=0, stable=True)", [(v.shape, None), (v.shape, N)])


@production("order")
def topk_cols(g):
    v = g.pick(_int_last)
    k = g.rng.randint(1, min(4, v.shape[-1]))
    g.define(f"torch.topk({v}, {k}, dim=-1).values", v.shape[:-1] + (k,))


@production("order", mixes_rows=True)
def topk_rows(g):
    v = g.pick(_rows())
    g.define(f"torch.topk({v}, 1, dim=0).values", (1,) + v.shape[1:])


@production("order")
def argmax_cols(g):
    v = g.pick(_int_last)
    g.define(f"{v}.{g.choice(['argmax', 'argmin'])}(-1)", v.shape[:-1], bound=v.shape[-1])


@production("order", mixes_rows=True)
def argmax_rows(g):
    v = g.pick(_rows())
    g.define(f"{v}.argmax(0)", v.shape[1:], bound=N)


@production("order", mixes_rows=True)
def argsort_rows(g):
    """A permutation of the rows, by one column (as tokens are sorted by expert)."""
    _row_permutation(g)


def _row_permutation(g) -> Var:
    v = g.pick(_rows(2))
    return g.define(f"torch.argsort({v}[:, {g.rng.randrange(v.shape[1])}], stable=True)", (N,), bound=N)


# indexing


@production("index", weight=2)
def embedding(g):
    i = g.pick(lambda i: isinstance(i.bound, int) and len(i.shape) in (1, 2), index=True)
    e = g.choice(DIMS[:3])
    table = g.param(f"torch.randn({i.bound}, {e}, generator=g)")
    g.define(g.choice([f"F.embedding({i}, {table})", f"{table}[{i}]"]), i.shape + (e,))


@production("index", weight=3)
def gather_cols(g):
    i = g.pick(lambda i: isinstance(i.bound, int) and len(i.shape) in (1, 2) and i.rows, index=True)
    width = i.shape[1] if len(i.shape) == 2 else 1
    v = g.pick(lambda v: _rows(2)(v) and isinstance(v.shape[1], int) and v.shape[1] >= i.bound)
    index = f"{i}[:, :{min(width, 4)}]" if len(i.shape) == 2 else f"{i}.unsqueeze(-1)"
    g.define(f"torch.gather({v}, -1, {index})", (N, min(width, 4)))


@production("index", weight=4, mixes_rows=True)
def index_rows(g):
    """Rows picked by indices computed over rows (argmax over dim 0, a sort over dim 0)."""
    i = g.pick(lambda i: i.bound == N and len(i.shape) in (1, 2), index=True)
    v = g.pick(_rows(2))
    # gather's result has the index's shape: rows only where the index has them (an argmax
    # over the rows of [n, a, b] is [a, b], which indexes like `v[i]` instead).
    if len(i.shape) == 2 and i.shape[0] == N and i.shape[1] <= v.shape[1] and g.rng.random() < 0.5:
        g.define(f"torch.gather({v}, 0, {i}[:, :{i.shape[1]}])", (N, i.shape[1]))
    else:
        g.define(f"{v}[{i}]", i.shape + v.shape[1:])


@production("index", mixes_rows=True)
def index_add_rows(g):
    """Rows scattered back by a permutation of the rows (as an MoE combines its experts'
    outputs): the permutation is the one `argsort_rows` makes, or one made here."""
    v = g.pick(_rows())
    try:
        i = g.pick(lambda i: i.bound == N and i.shape == (N,), index=True)
    except Skip:
        i = _row_permutation(g)
    g.define(f"torch.zeros_like({v}).index_add_(0, {i}, {v})", v.shape)


# cat, split, slices


@production("cat")
def cat_cols(g):
    a = g.pick(lambda v: v.rows and len(v.shape) >= 2)
    b = g.pick(lambda v: v.rows and len(v.shape) == len(a.shape) and v.shape[:-1] == a.shape[:-1])
    g.define(f"torch.cat([{a}, {b}], dim=-1)", a.shape[:-1] + (a.shape[-1] + b.shape[-1],))


@production("cat")
def chunk(g):
    v = g.pick(lambda v: _int_last(v) and v.shape[-1] % 2 == 0)
    d = v.shape[-1]
    if g.rng.random() < 0.5:
        g.define_many(f"{v}.chunk(2, dim=-1)", [(v.shape[:-1] + (d // 2,), None)] * 2, view_of=v)
    else:
        k = g.rng.randint(1, d - 1)
        g.define_many(f"torch.split({v}, [{k}, {d - k}], dim=-1)",
                      [(v.shape[:-1] + (k,), None), (v.shape[:-1] + (d - k,), None)], view_of=v)


@production("cat")
def slice_cols(g):
    v = g.pick(lambda v: len(v.shape) >= 2 and _int_last(v) and v.shape[-1] >= 4)
    d = v.shape[-1]
    k = g.rng.randint(1, d - 1)
    form, width = g.choice([(f"{v}[..., :{k}]", k), (f"{v}[..., {k}:]", d - k), (f"{v}[..., ::2]", (d + 1) // 2)])
    g.define(form, v.shape[:-1] + (width,), view_of=v)


@production("cat", mixes_rows=True)
def select_row(g):
    """The first or last row (the last token's hidden state, as LM heads take it)."""
    v = g.pick(_rows())
    form, shape = g.choice([(f"{v}[0]", v.shape[1:]), (f"{v}[-1]", v.shape[1:]), (f"{v}[-1:]", (1,) + v.shape[1:])])
    g.define(form, shape, view_of=v)


@production("cat", mixes_rows=True)
def shift_rows(g):
    """A token shift: every row takes its neighbour's value, the edge a parameter's."""
    v = g.pick(_rows(2))
    edge = g.param(f"torch.randn(1, {v.shape[1]}, generator=g)")
    g.define(g.choice([f"torch.cat([{edge}, {v}[:-1]], dim=0)", f"torch.cat([{v}[1:], {edge}], dim=0)",
                       f"F.pad({v}, (0, 0, 1, 0))[:-1]", f"F.pad({v}[1:], (0, 0, 0, 1))"]), v.shape)


@production("cat", mixes_rows=True)
def flip_rows(g):
    v = g.pick(_rows())
    g.define(g.choice([f"{v}.flip(0)", f"{v}.roll(1, 0)", f"torch.roll({v}, -1, 0)"]), v.shape)


@production("cat", mixes_rows=True)
def halves_rows(g):
    """The first half of the rows treated apart from the second: where it splits depends
    on n. (A mask, not slices: a slice of one row makes Dynamo specialize on n // 2 == 1.)"""
    v = g.pick(_rows())
    ones = ", 1" * (len(v.shape) - 1)
    pos = f"torch.arange({v}.shape[0], device={v}.device).view(-1{ones})"
    g.define(f"torch.where({pos} < {v}.shape[0] // 2, {v} * 2.0, {v})", v.shape)


# in-place updates of intermediates


@production("inplace")
def inplace_scale(g):
    v = g.pick()
    g.mutate(v, g.choice([f"{v}.mul_(2.0)", f"{v}.add_(0.5)", f"{v}.clamp_(-1.0, 1.0)", f"{v}.sin_()"]))


@production("inplace")
def inplace_slice(g):
    v = g.pick(lambda v: len(v.shape) >= 2 and _int_last(v) and v.shape[-1] >= 2)
    g.mutate(v, g.choice([f"{v}[..., :2] += 1.0", f"{v}[..., 1::2] *= 0.5", f"{v}[..., 0] = 0.0"]))


@production("inplace")
def inplace_add(g):
    v = g.pick()
    u = g.pick(lambda u: _broadcasts_into(v)(u) and u.base != v.base)
    g.mutate(v, f"{v}.{g.choice(['add_', 'mul_'])}({u})")


@production("inplace", mixes_rows=True)
def inplace_row(g):
    v = g.pick(_rows())
    g.mutate(v, g.choice([f"{v}[0] += 1.0", f"{v}[-1] *= 0.5"]))


@production("inplace", mixes_rows=True)
def buffer_write(g):
    """Rows written into a buffer at their positions (as into a KV cache), then the whole
    buffer read: rows past n hold what earlier calls wrote. Sizes stay below its 16 rows."""
    v = g.pick(_rows(2))
    buf = g.param(f"torch.zeros(16, {v.shape[1]})", buffer=True)
    positions = f"torch.arange({v}.shape[0], device={v}.device)"
    g.write_state(g.choice([f"{buf}[:{v}.shape[0]] = {v}", f"{buf}.index_copy_(0, {positions}, {v})"]))
    g.define(f"{buf} * 1.0", (16, v.shape[1]))


@production("inplace", mixes_rows=True)
def buffer_update(g):
    """A running statistic kept in a buffer (as batch norm's in training): it mixes rows."""
    v = g.pick(_rows(2))
    buf = g.param(f"torch.zeros({v.shape[1]})", buffer=True)
    g.write_state(f"{buf}.mul_(0.9).add_({v}.mean(0), alpha=0.1)")
    g.define(f"{buf} * 1.0", (v.shape[1],))


# state kept across calls: a plain attribute holding a view of what a call made


@production("state", mixes_rows=True)
def state_window(g):
    """The last k rows seen, over this call and the calls before it: the window a call
    keeps is a view of its cat. Its shape does not depend on n: it carries across sizes."""
    v = g.pick(_rows(2))
    k, d = g.rng.randint(1, 4), v.shape[1]
    s = g.state(rows=False)
    g.write_state(f"if {s} is None:  # the first call: an empty window")
    g.write_state(f"    {s} = {v}.new_zeros({k}, {d})")
    cat = f"torch.cat([{s}, {v}])"
    t = g.define(g.choice([f"{cat}[-{k}:]", f"{cat}[{v}.shape[0]:]"]), (k, d))
    g.write_state(f"{s} = {t}  # kept for the next call: a view of this call's cat")


@production("state")
def state_shift(g):
    """A sliding-window KV cache, one per row: the cache and the new entries are cat
    together and the cache kept is a view of that (`full[:, 1:]`). It starts over when n
    changes, so a row's result depends on that row's history alone."""
    v = g.pick(_rows(2))
    s = g.state(rows=True)
    g.write_state(f"if {s} is None or {s}.shape[0] != {v}.shape[0]:  # a new batch: the cache starts over")
    if g.rng.random() < 0.5:  # entries along a new dim: [n, w, d]
        w, d = g.rng.randint(1, 4), v.shape[1]
        g.write_state(f"    {s} = {v}.new_zeros({v}.shape[0], {w}, {d})")
        full = g.define(f"torch.cat([{s}, {v}[:, None]], dim=1)", (N, w + 1, d))
        g.write_state(f"{s} = {full}[:, 1:]  # kept for the next call: a view of {full}")
    else:  # columns: [n, w]
        c, w = g.rng.randint(1, min(4, v.shape[1])), g.choice((2, 4, 8))
        g.write_state(f"    {s} = {v}.new_zeros({v}.shape[0], {w})")
        full = g.define(f"torch.cat([{s}, {v}[:, :{c}]], dim=1)", (N, w + c))
        g.write_state(f"{s} = {full}[:, {c}:]  # kept for the next call: a view of {full}")


@production("state", mixes_rows=True)
def state_slots(g):
    """A cache of 16 slots, one per row, kept across sizes: rows n.. shift in zeros (a
    value of n: padding rows must not reach them). Sizes stay within its 16 slots."""
    v = g.pick(_rows(2))
    c, w = g.rng.randint(1, min(4, v.shape[1])), g.choice((2, 4))
    s = g.state(rows=False)
    g.write_state(f"if {s} is None:  # the first call: empty slots")
    g.write_state(f"    {s} = {v}.new_zeros(16, {w})")
    new = f"F.pad({v}[:, :{c}], (0, 0, 0, 16 - {v}.shape[0]))"
    full = g.define(f"torch.cat([{s}, {new}], dim=1)", (16, w + c))
    g.write_state(f"{s} = {full}[:, {c}:]  # kept for the next call: a view of {full}")


# the capture size used as a value


@production("size_value", mixes_rows=True)
def size_value(g):
    v = g.pick(_rows())
    g.define(g.choice([f"{v} + {v}.shape[0]", f"{v} / {v}.size(0)", f"{v} * (1.0 / {v}.shape[0])"]), v.shape)


@production("size_value")
def arange_rows(g):
    """Row positions: torch.arange(n), as position ids are built."""
    v = g.pick(_rows())
    ones = ", 1" * (len(v.shape) - 1)
    pos = f"torch.arange({v}.shape[0], device={v}.device, dtype={v}.dtype).view(-1{ones})"
    g.define(f"{v} + {pos} * 0.1", v.shape)


@production("size_value")
def rotary(g):
    v = g.pick(_rows(2))
    freq = g.param(f"torch.rand({v.shape[1]}, generator=g)")
    angle = f"torch.arange({v}.shape[0], device={v}.device).float()[:, None] * {freq}"
    g.define(f"{v} * torch.cos({angle}) + {v}.flip(-1) * torch.sin({angle})", v.shape)


# custom split ops (cgcompile.testing.models)


OPS = "torch.ops.cgcompile_testing"


@production("split", weight=2)
def split_attention(g):
    q = g.pick(lambda v: len(v.shape) >= 1)
    k = g.pick(_same_shape(q))
    v = g.pick(_same_shape(q))
    g.define(f"{OPS}.silly_attention({q}, {k}, {v})", q.shape)


@production("split")
def split_pair(g):
    q = g.pick(lambda v: len(v.shape) >= 1)
    k = g.pick(_same_shape(q))
    g.define_many(f"{OPS}.silly_pair({q}, {k})", [(q.shape, None), (q.shape, None)])


@production("split")
def split_accumulate(g):
    acc = g.pick(lambda v: len(v.shape) >= 1)
    x = g.pick(lambda v: v.shape == acc.shape and v.base != acc.base)
    g.mutate(acc, f"{OPS}.silly_accumulate({acc}, {x})")


@production("split")
def split_transposed(g):
    v = g.pick(_nd(2))
    g.define(f"{OPS}.silly_transposed({v})", v.shape)


@production("split")
def split_adjacent(g):
    """Two split ops back to back, the second reading the first's non-contiguous result."""
    v = g.pick(_nd(2))
    t = g.define(f"{OPS}.silly_transposed({v})", v.shape)
    g.define(f"{OPS}.silly_attention({t}, {v}, {t})", v.shape)


# writes into an input, drawn last (`generate`): what the program does may be only these


@production("sink")
def sink_accumulate(g):
    """A tensor accumulated into `out` by the split op; sometimes a capturable piece
    then scales `out` in place (a graph piece that writes into a graph input)."""
    t = g.pick(_rows(2))
    out = g.input_to_write(t.shape)
    g.write_input(out, f"{OPS}.silly_accumulate({out}, {t})")
    if g.rng.random() < 0.5:
        g.write_input(out, f"{out}.mul_({g.choice(['0.5', '-2.0'])})")


@production("sink")
def sink_view(g):
    """Columns of a tensor accumulated into columns of `out`, through views a capturable
    piece makes and the split op writes through."""
    t = g.pick(lambda v: _rows(2)(v) and v.shape[1] >= 2)
    d = t.shape[1]
    k = g.rng.randint(1, d - 1)
    out = g.input_to_write(t.shape)
    target, source = g.choice([(f"{out}[:, :{k}]", f"{t}[:, {d - k}:]"), (f"{out}[:, {k}:]", f"{t}[:, :{d - k}]")])
    g.write_input(out, f"{OPS}.silly_accumulate({target}, {source})")


# -- generation ------------------------------------------------------------------------------


def _inputs(rng: random.Random) -> tuple[Var, ...]:
    inputs = [Var("x", (N, rng.choice(DIMS)), "x")]
    if rng.random() < 0.3:
        inputs.append(Var("y", (N, rng.choice((4, 8, 12))), "y"))
    if rng.random() < 0.4:
        inputs.append(Var("ids", (N,), "ids", bound=rng.choice((16, 32))))
    return tuple(inputs)


MODES = ("any", "row_local", "one_mixing")  # and their odds below
RETURNS = ("outputs", "nothing", "empty")  # forward returns its outputs, has no return, returns ()
LAYOUTS = {  # how make_inputs lays out a float input [n, d]
    "contiguous": "torch.randn(n, {d}, generator=g).to(device)",
    "transposed": "torch.randn({d}, n, generator=g).to(device).t()",  # strides (1, n)
    "strided": "torch.randn(n, {d2}, generator=g).to(device)[:, ::2]",  # strides (2d, 2)
}


def generate(seed: int, max_steps: int = 10, *, stateful: bool = False) -> Program:
    """The program of a seed: deterministic, 3 to `max_steps` steps.

    A program draws from every production ("any"), from those that keep rows apart
    ("row_local": such a graph is padded, which exercises the padded runtime), or from
    those plus one row-mixing production at a random step ("one_mixing": the one op the
    padding-safety analysis must catch on its own). A split op may be forced first and last.
    stateful: the "state" productions join, one forced at a random step; without it no
    draw changes, so a seed's program stays what it was before they existed.
    Some programs without state end with a "sink" production (a write into an input) and
    may return nothing (`_sink`).
    """
    rng = random.Random(seed)
    inputs = _inputs(rng)
    builder = _Builder(rng, inputs)
    length = rng.randint(3, max_steps)
    mode = rng.choices(MODES, weights=(4, 3, 3))[0]
    mixing_step = rng.randrange(length) if mode == "one_mixing" else None
    split_at_start, split_at_end = rng.random() < 0.2, rng.random() < 0.2
    state_step = rng.randrange(length) if stateful else None
    for i in range(length):
        forced_split = (i == 0 and split_at_start) or (i == length - 1 and split_at_end)
        candidates = _candidates(mode, i == mixing_step, forced_split, stateful, i == state_step)
        for _ in range(20):
            p = rng.choices(candidates, weights=[p.weight for p in candidates])[0]
            if builder.run(p.name, p.emit):
                break
    # Drawn last, so that adding them kept the programs earlier draws make:
    layout = rng.choices(list(LAYOUTS), weights=(6, 2, 2))[0]
    inference_mode = rng.random() < 0.3
    returns = "outputs" if stateful else _sink(builder, rng)
    return Program(seed, inputs + tuple(builder.new_inputs), tuple(builder.steps), mode, layout, inference_mode,
                   stateful, returns)


def _sink(builder: _Builder, rng: random.Random) -> str:
    """For about one program in seven, a last step that writes into an input; returns
    what the program returns (`RETURNS`). Drawn after every other draw, so that the
    programs other seeds make stay what they were, and those with a sink keep their
    other steps (dead code where it returns nothing, which Dynamo drops)."""
    if rng.random() >= 0.15:
        return "outputs"
    sinks = [p for p in PRODUCTIONS if p.family == "sink"]
    for _ in range(20):
        p = rng.choice(sinks)
        if builder.run(p.name, p.emit):
            return rng.choice(RETURNS)
    return "outputs"


def _candidates(mode: str, mixing_step: bool, split: bool, stateful: bool, state_step: bool) -> list[Production]:
    drawn = [p for p in PRODUCTIONS if (stateful or p.family != "state") and p.family != "sink"]
    if state_step:
        return [p for p in drawn if p.family == "state" and (mode == "any" or mixing_step or not p.mixes_rows)]
    if split:
        return [p for p in drawn if p.family == "split"]
    if mixing_step:
        return [p for p in drawn if p.mixes_rows]
    return [p for p in drawn if mode == "any" or not p.mixes_rows]


# -- rendering as source ---------------------------------------------------------------------


def source(program: Program) -> str:
    """The module of a program: `Model`, `make_inputs(n, device)`, and `mark_state(model)`
    where the model keeps state whose dim 0 is the capture dimension."""
    params = [p for s in program.steps for p in s.params]
    inputs = program.used_inputs()
    init = [f"        {p.source()}" for p in params]
    body = [f"        {line}" for s in program.steps for line in s.lines]
    signature = ", ".join(v.name for v in inputs)
    shapes = ", ".join(f"{v}: {_describe(v)}" for v in inputs)
    lines = [
        "class Model(torch.nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
        *([f"        g = torch.Generator().manual_seed({program.seed})"] if init else []),
        *init,
        "",
        f"    def forward(self, {signature}):  # {shapes}",
        *body,
        *_return_source(program),
        "",
        "",
        *_make_inputs_source(program, inputs),
        *_mark_state_source(program),
    ]
    return "\n".join(lines) + "\n"


def _return_source(program: Program) -> list[str]:
    if program.returns == "nothing":
        return [f"        # returns nothing: what it does is write into {', '.join(map(str, program.written_inputs))}"]
    return [f"        return {_tuple_source(v.name for v in program.outputs)}"]


def _make_inputs_source(program: Program, inputs: Sequence[Var]) -> list[str]:
    def make(v: Var) -> str:
        if v.is_index:
            return f"torch.randint(0, {v.bound}, (n,), generator=g).to(device)"
        return LAYOUTS[program.layout].format(d=v.shape[1], d2=2 * v.shape[1])

    return [
        "def make_inputs(n, device):",
        "    # dim 0 of every input is the capture dimension, marked dynamic (Dynamo specializes n=1)",
        f"    g = torch.Generator().manual_seed({program.seed} * 1000 + n)",
        f"    inputs = {_tuple_source(make(v) for v in inputs)}",
        "    for t in inputs:",
        "        if n > 1:",
        "            torch._dynamo.mark_dynamic(t, 0)",
        "    return inputs",
    ]


def _mark_state_source(program: Program) -> list[str]:
    """Per-row state is a graph input whose dim 0 equals n: marked dynamic, as the inputs
    are (unmarked, Dynamo would specialize n to it, against the inputs' marks)."""
    if not program.row_states:
        return []
    return [
        "",
        "",
        "def mark_state(model):",
        "    # before each call: per-row state kept across calls is marked dynamic, as the inputs are",
        f"    for state in {_tuple_source(f'model.{name}' for name in program.row_states)}:",
        "        if state is not None and state.shape[0] > 1:",
        "            torch._dynamo.mark_dynamic(state, 0)",
    ]


def _tuple_source(items) -> str:
    items = list(items)
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"  # () when empty


HEADER = (
    "import torch\nimport torch.nn.functional as F\n\n"
    "import cgcompile\nimport cgcompile.testing.models  # registers the split ops\n\n\n"
)


def load(program: Program) -> dict:
    """exec the program's source; returns its namespace (Model, make_inputs)."""
    namespace: dict = {}
    exec(compile(HEADER + source(program), f"<fuzz case {program.seed}>", "exec"), namespace)
    return namespace
