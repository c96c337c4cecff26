"""Dynamo's check of each DTensor parameter's spec, done by cgcompile at every call instead.

A model whose parameters are DTensor shards (transformers' `tp_plan="auto"`, torch's
`parallelize_module`) makes Dynamo check every parameter's DTensor spec (mesh, placements,
dtype) at every call, in a Python guard each (`DTENSOR_SPEC_MATCH`): several microseconds a
parameter, paid for hundreds of parameters by a step that is otherwise one CUDA graph
replay. `without_parameter_spec_guards` is a Dynamo guard filter that drops those guards
on parameters only:

    from cgcompile.parallel.dtensor_guards import without_parameter_spec_guards
    forward = torch.compile(model.forward, backend=backend,
                            options={"guard_filter_fn": without_parameter_spec_guards})

The check stays: every graph with DTensor parameter inputs gets a `ParameterSpecs`, which
the runtime runs first at every call. It compares each parameter's spec with the one the
graph was compiled for: by identity, all in C (`map(operator.is_, ...)`), while the spec
objects stay; else by Dynamo's own equality, once per new object. A spec that differs
raises `CGCompileError`: without its guard Dynamo would not compile the graph again, and
the call would run code traced for other placements. (With Dynamo's guards kept, a
changed spec recompiles before this runs, so it never fires.)
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch

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
                    "Dynamo's spec guard was dropped (guard_filter_fn=without_parameter_spec_guards), so it did "
                    "not compile again; compile without that filter where parameters are resharded", raw=True))
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
