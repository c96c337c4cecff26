"""Dynamo's check of each DTensor parameter's spec, done by cgcompile at every call instead.

A model whose parameters are DTensor shards (transformers' `tp_plan="auto"`, torch's
`parallelize_module`) makes Dynamo check every parameter's DTensor spec (mesh, placements,
dtype) at every call, in a Python guard each (`DTENSOR_SPEC_MATCH`): several microseconds a
parameter, paid for hundreds of parameters by a step that is otherwise one CUDA graph
replay.

So every graph with DTensor parameter inputs gets a `ParameterSpecs`, which the runtime
runs first at every call. It compares each parameter's spec with the one the graph was
compiled for: by identity, all in C (`map(operator.is_, ...)`), while the spec objects
stay; else by Dynamo's own equality, once per new object. By default
(`Config.dtensor_spec_guards="cgcompile"`) the backend then takes Dynamo's spec guards of
exactly those parameters out of the frame's guards (`drop_checked_spec_guards`), before
Dynamo builds them: a spec that differs then raises `CGCompileError`, as Dynamo would not
compile the graph again and the call would run code traced for other placements. (On a
torch whose guard set cannot be reached, nothing is dropped, and a warning says so once.)
`dtensor_spec_guards="dynamo"` keeps Dynamo's guards, so that a resharded parameter
compiles again (and the check here never fires).

`without_parameter_spec_guards` is the same drop as a Dynamo guard filter, for backends
that keep Dynamo's guards:

    forward = torch.compile(model.forward, backend=backend,
                            options={"guard_filter_fn": without_parameter_spec_guards})
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch

from .. import compat
from ..errors import CGCompileError, expected

SPEC_GUARD = "DTENSOR_SPEC_MATCH"


def without_parameter_spec_guards(entries: Sequence) -> list[bool]:
    """A `guard_filter_fn` for `torch.compile(..., options=...)`: keep every guard but the
    DTensor spec guards of parameters (`..._parameters['name']`), which cgcompile checks."""
    return [not (entry.guard_type == SPEC_GUARD and "_parameters[" in entry.name) for entry in entries]


_spec_of = operator.attrgetter("_spec")


class ParameterSpecs:
    """The DTensor specs of a graph's parameter inputs, checked at every call."""

    def __init__(self, graph: str, indices: Sequence[int], names: Sequence[str], example_inputs: Sequence):
        self.graph = graph
        self.indices = tuple(indices)
        self.names = tuple(names)
        self._pick = operator.itemgetter(*self.indices) if len(self.indices) > 1 else (
            lambda args, i=self.indices[0]: (args[i],))
        self._specs = list(map(_spec_of, self._pick(example_inputs)))

    def check(self, args: Sequence) -> None:
        tensors = self._pick(args)
        specs = list(map(_spec_of, tensors))
        if all(map(operator.is_, specs, self._specs)):
            return
        for k, (spec, compiled) in enumerate(zip(specs, self._specs)):
            if spec is not compiled and not spec._check_equals(compiled, skip_shapes=True):
                raise CGCompileError(expected(
                    f"cgcompile: {self.graph}: the DTensor parameter {self.names[k]!r}",
                    f"the spec its graph was compiled for ({compiled})", str(spec),
                    "Dynamo's spec guard was dropped (cgcompile checks the spec instead), so it did not "
                    "compile again; where parameters are resharded, compile with "
                    "Config(dtensor_spec_guards='dynamo') and without guard_filter_fn=without_parameter_spec_guards",
                    raw=True))
        self._specs = specs  # equal specs in new objects: compared by identity from now on


def parameter_specs(graph: str, names: Sequence[str], example_inputs: Sequence) -> ParameterSpecs | None:
    """The watch of a graph's DTensor parameter inputs (`names`: its placeholders'), or None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    found = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter) and isinstance(x, DTensor)]
    if not found:
        return None
    return ParameterSpecs(graph, found, [names[i] for i in found], example_inputs)


def drop_checked_spec_guards(specs: ParameterSpecs, sources: Sequence) -> int | None:
    """Take Dynamo's spec guards of the parameters `specs` checks out of the frame being
    compiled (a backend only, see `compat.drop_frame_guards`); how many, None outside
    Dynamo. `sources`: each
    graph input's Dynamo source (`compat.graph_input_sources`). A guard on a DTensor that is
    not one of those inputs (an activation, a parameter read only for its metadata, a tied
    parameter's second name) stays."""
    checked = {sources[i].name for i in specs.indices if i < len(sources) and sources[i] is not None}

    def is_checked_spec_guard(guard) -> bool:
        source = guard.originating_source
        return (guard.inner_create_fn().__name__ == SPEC_GUARD and getattr(source, "member", None) == "_spec"
                and getattr(getattr(source, "base", None), "name", None) in checked)

    return compat.drop_frame_guards(is_checked_spec_guard if checked else lambda guard: False)
