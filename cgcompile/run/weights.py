"""Whether a call may replay CUDA graphs that read parameters and buffers in place.

Graphs read a model's parameters and buffers at the addresses they were captured with.
Those addresses can change under the same graphs:
  - Dynamo reuses one compiled graph for every instance of a module class (parameters
    are graph inputs), so a second model of the same class and shapes, compiled with the
    same backend, calls the first model's graphs with its own parameters;
  - a parameter is replaced (`param.data = ...`, `module.weight = ...`, a new state dict
    loaded into new tensors, a submodule swapped for another).
A replay would then compute with the old tensors. `ParameterAddresses` compares the
addresses of each call with those of the capture: a call that differs runs without
graphs (correct, slower; a warning says so once); a second call in a row with the same
new addresses means they settled (new weights): the graphs are dropped and captured
again. Instances that alternate therefore never replay each other's graphs and never
recapture at every call. The check costs one `data_ptr()` per parameter and buffer.
A wrapper subclass (a DTensor shard, quantized weights) has no memory of its own: the
graphs read the tensors it wraps, so those are the addresses watched (`storage_tensors`).

Two readers feed it: the compiled path reads the graph's inputs (`allow(args)`), the
breakable path reads the captured module itself (`ModuleTensors`).
"""

from __future__ import annotations

import logging
import operator
from typing import Callable, Sequence

import torch

from ..passes import wrapped_tensors

log = logging.getLogger(__name__)

_DYNAMO_ADVICE = ("Dynamo reuses compiled code for every instance of a module class: give each model its own "
                  "backend (torch.compile(m, backend=cgcompile.Backend())) to get graphs for each. Tensors "
                  "marked static (torch._dynamo.mark_static_address), and tensors the graph writes in place (a "
                  "KV cache), are watched too: generate() makes a new cache at every call; pass one cache to every "
                  "call (generate(past_key_values=cache), after cache.reset()) to keep the graphs.")


_data_ptr = torch.Tensor.data_ptr


def _picker(indices: tuple[int, ...]) -> Callable[[Sequence], tuple]:
    """args -> (args[i] for i in indices), as a tuple, whatever the number of indices."""
    if len(indices) == 1:
        index = indices[0]
        return lambda args: (args[index],)
    return operator.itemgetter(*indices) if indices else (lambda args: ())


class ParameterAddresses:
    """indices: positions of the parameters and buffers among a graph's inputs (for `allow`);
    names: what each address is, for the log; drop_graphs: forgets the graphs that read
    them (they are captured again lazily); advice: what the warning tells the user;
    warned: names already warned about, shared by watches that should warn once together."""

    def __init__(self, name: str, indices: Sequence[int], names: Sequence[str], drop_graphs: Callable[[], None],
                 *, advice: str = _DYNAMO_ADVICE, warned: set | None = None, wrapped: Sequence[int] = ()):
        self.name = name
        self.indices = tuple(indices)
        self._pick = _picker(self.indices)
        self.wrapped = tuple(wrapped)  # inputs that are wrapper subclasses: their inner tensors' addresses
        self._inner: WrappedAddresses | None = None  # their reader, made at the first call
        self.names = names
        self.drop_graphs = drop_graphs
        self.advice = advice
        self.captured: list[int] | None = None  # the addresses the graphs hold
        self._moved: list[int] | None = None  # the addresses of the last call, if they differed
        self.calls_without_graphs = 0
        self.recaptures = 0
        self._warned = warned if warned is not None else set()

    def allow(self, args: Sequence) -> bool:
        """Whether this call of the graph may replay (or capture) graphs."""
        # Every call reads every address: picked out and read in C (itemgetter, map), not
        # through a Python loop, about half the host time for a model's parameters.
        addresses = list(map(_data_ptr, self._pick(args)))
        if self.wrapped:
            if self._inner is None:
                self._inner = WrappedAddresses(self.wrapped, args)
            addresses += self._inner.read(args)
        return self.allow_addresses(addresses)

    def allow_addresses(self, addresses: list[int]) -> bool:
        """Whether a call whose parameters and buffers lie at `addresses` may replay graphs."""
        if addresses == self.captured:
            self._moved = None
            return True
        if self.captured is None:
            self.captured = addresses
            return True
        if addresses == self._moved:  # the same new addresses twice in a row: settled
            log.info("cgcompile: %s: its parameters and buffers moved (%s); its CUDA graphs are "
                     "captured again", self.name, self._first_difference(addresses))
            self.drop_graphs()
            self.captured, self._moved = addresses, None
            self.recaptures += 1
            return True
        self._moved = addresses
        self.calls_without_graphs += 1
        if self.name not in self._warned:
            self._warned.add(self.name)
            log.warning(
                "cgcompile: %s was captured with other parameters or state tensors than this call passes "
                "(%s), so this call runs without CUDA graphs.%s Tensors replaced by new ones are captured "
                "again from the second call that passes them; weights updated in place (param.data.copy_) "
                "keep the graphs.",
                self.name, self._first_difference(addresses), f" {self.advice}" if self.advice else "")
        return False

    def _first_difference(self, addresses: list[int]) -> str:
        if len(addresses) != len(self.captured):
            return f"it has {len(addresses)} parameters and buffers, captured with {len(self.captured)}"
        for name, now, then in zip(self.names, addresses, self.captured):
            if now != then:
                return f"{name!r} is at {now:#x}, captured at {then:#x}"
        return "no difference"


class ModuleTensors:
    """The addresses of a module's parameters and buffers, read cheaply at every call.

    The slots (each submodule's parameter and buffer dicts) are found once; a call reads
    one `data_ptr()` per slot. A submodule replaced by another object is noticed too: the
    slots are found again, and the new module's tensors have other addresses.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.names: list[str] = []
        self._find_slots()

    def _find_slots(self) -> None:
        self._slots, self._wrapped_slots, self._tree, names, wrapped_names = [], [], [], [], []
        for prefix, sub in self.module.named_modules(remove_duplicate=False):
            for kind in (sub._parameters, sub._buffers):
                for key, tensor in kind.items():
                    name = f"{prefix}.{key}" if prefix else key
                    if tensor is None:
                        continue
                    if has_address(tensor):
                        self._slots.append((kind, key))
                        names.append(name)
                    elif inner := [inner_name for inner_name, _ in storage_tensors(tensor, name)]:
                        self._wrapped_slots.append((kind, key, InnerAddresses(tensor)))
                        wrapped_names += inner
            self._tree.extend((sub._modules, key, child) for key, child in sub._modules.items())
        self.names[:] = names + wrapped_names  # in place: a watch holds this list for its messages

    def read(self) -> list[int]:
        for modules, key, child in self._tree:
            if modules.get(key) is not child:
                self._find_slots()
                break
        try:
            return self._addresses()
        except (KeyError, AttributeError):  # a parameter deleted or set to None: find the slots again
            self._find_slots()
            return self._addresses()

    def _addresses(self) -> list[int]:
        addresses = [kind[key].data_ptr() for kind, key in self._slots]
        for kind, key, inner in self._wrapped_slots:
            addresses += inner.read(kind[key])
        return addresses


def storage_tensors(tensor: torch.Tensor, name: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each tensor with memory that `tensor` reads: itself, or for a
    traceable wrapper subclass (DTensor, quantized weights) the inner tensors it flattens
    to, recursively ("w._local_tensor"); none for a tensor without memory."""
    return [(inner_name, inner) for inner_name, inner in wrapped_tensors(tensor, name) if has_address(inner)]


class InnerAddresses:
    """The addresses of what a wrapper subclass reads (`storage_tensors`), read at every call
    through the attribute paths found once: walking `__tensor_flatten__` costs about 4 us a
    DTensor, which a tensor-parallel model pays for each of its hundreds of parameters.
    A tensor whose paths no longer lead to tensors with memory (another subclass in that
    slot) is walked in full."""

    def __init__(self, example: torch.Tensor):
        self._paths = [operator.attrgetter(name[1:]) for name, _ in storage_tensors(example, "")]

    def read(self, tensor: torch.Tensor) -> list[int]:
        try:
            addresses = [path(tensor).data_ptr() for path in self._paths]
        except AttributeError:
            addresses = []
        if 0 in addresses or not addresses:
            return [inner.data_ptr() for _, inner in storage_tensors(tensor, "")]
        return addresses


class WrappedAddresses:
    """The addresses of what a graph's wrapper-subclass inputs read, input by input in
    `indices` order. Where each wraps one tensor at the same attribute path (every
    DTensor's `_local_tensor`), all are read in C (`map`), about a tenth of a Python loop's
    time over a tensor-parallel model's hundreds of shards; else input by input
    (`InnerAddresses`)."""

    def __init__(self, indices: Sequence[int], example_args: Sequence):
        self.indices = tuple(indices)
        paths = {tuple(name for name, _ in storage_tensors(example_args[i], "")) for i in self.indices}
        shared = next(iter(paths)) if len(paths) == 1 else ()
        self._pick = _picker(self.indices)
        self._shared = operator.attrgetter(shared[0][1:]) if len(shared) == 1 else None
        self._each = None if self._shared else [(i, InnerAddresses(example_args[i])) for i in self.indices]

    def read(self, args: Sequence) -> list[int]:
        if self._shared is not None:
            try:
                addresses = list(map(_data_ptr, map(self._shared, self._pick(args))))
            except AttributeError:  # another kind of tensor in a slot: walked in full below
                addresses = []
            if addresses and 0 not in addresses:
                return addresses
            return [inner.data_ptr() for i in self.indices for _, inner in storage_tensors(args[i], "")]
        addresses = []
        for i, inner in self._each:
            addresses += inner.read(args[i])
        return addresses


def has_address(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has memory of its own; a wrapper subclass (quantized weights) has
    none (its data_ptr is 0, or raises, depending on the torch version), nor has an empty
    tensor."""
    try:
        return tensor.data_ptr() != 0
    except RuntimeError:
        return False
