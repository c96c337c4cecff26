"""One-row products that read the same input, grouped so that one launch computes them all.

A decoder's q, k and v linears read one normed hidden state, as its gate and up linears
read another. `find_skinny_groups(gm, max_features, max_members)` groups the products that
`find_skinny_linears` lists by the node they read, or equal reshapes of one node (so by
dtype, device and K too), and by whether they add a bias, 2 to `max_members` a group, in
graph order; `rewrite_skinny_groups(gm, target, max_features, max_members)` replaces each
group with one call `target(x, [w_0, ...], [b_0, ...] or [])` (x: the first member's
input), which must return the members' outputs side by side, [1, N_0 + ...], as
`torch.cat` of their products would (to rounding), and gives each member's users a slice
of its columns. Products no group takes are left to `rewrite_skinny_linears`.

Where the call goes. It replaces products that may lie apart, with other nodes between
them, among them users of the earlier members. It goes right before the first node that
uses any member's result (or right after the last member, when none is used before), so
it comes before every use of every member. Every operand must come before it: graph inputs
and what precedes that point do; a view of graph inputs (a transposed weight, a DTensor
shard's view) that lies after it is moved up before it; a group that needs anything else
moved is not made (the member that brought it starts a group of its own). A member computed
earlier or later than it was must read the same operands, so no group spans a node that
writes to memory (`Node.is_impure`). The result is checked by `graph.lint()`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import GraphModule, Node

from .graph_values import ATEN_RESHAPES, example_value, meta_with_value
from .skinny_linear import SkinnyLinear, find_skinny_linears

_aten = torch.ops.aten
# Views that may move up before a group's call: they read only their inputs' metadata.
_MOVABLE_VIEWS = frozenset({
    _aten.permute.default, _aten.t.default, _aten.view.default, _aten._unsafe_view.default,
    _aten.reshape.default, _aten.alias.default, _aten.expand.default, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.slice.Tensor, _aten.select.int, _aten.as_strided.default,
})


@dataclasses.dataclass(frozen=True)
class SkinnyGroup:
    """Products of one row that read the same input, and where their one call goes."""

    members: tuple[SkinnyLinear, ...]  # in graph order
    point: Node  # the call goes right before this node
    moved: tuple[Node, ...]  # views of graph inputs to move before `point`, each after its inputs

    @property
    def x(self) -> Node:  # [1, K]
        return self.members[0].x


def find_skinny_groups(gm: GraphModule, max_features: int, max_members: int) -> list[SkinnyGroup]:
    """The groups `rewrite_skinny_groups` would make first, as the graph is now, in graph order."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    reading: dict[tuple, list[SkinnyLinear]] = {}
    for match in find_skinny_linears(gm, max_features):
        reading.setdefault((_input_key(match.x), match.bias is not None), []).append(match)
    groups = [group for members in reading.values() for group in _grouped(members, order, max_members)]
    return sorted(groups, key=lambda group: order[group.members[0].product])


def rewrite_skinny_groups(gm: GraphModule, target, max_features: int, max_members: int) -> int:
    """Replace each group `find_skinny_groups` finds with one `target` call and per-member
    slices; the number of products replaced. A rewrite erases nodes a later group was found
    with (a product one reads as its input), so each group is found on the graph as the
    rewrites before it left it: one search per group."""
    count = 0
    while groups := find_skinny_groups(gm, max_features, max_members):
        _rewrite(gm, groups[0], target)
        count += len(groups[0].members)
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _input_key(node: Node):
    """What `node` computes, read through reshapes: a linear of a 3-d input reshapes it to
    [1, K] itself, so siblings read equal views of one node where the graph was not CSE'd."""
    if node.op == "call_function" and node.target in ATEN_RESHAPES:
        return (node.target, _input_key(node.args[0]), *[tuple(a) if isinstance(a, list) else a for a in node.args[1:]])
    return node


def _grouped(members: list[SkinnyLinear], order: dict[Node, int], max_members: int) -> list[SkinnyGroup]:
    """`members` (same input, graph order) in groups of 2 to `max_members`, greedily: a member
    that cannot join the group so far starts the next one."""
    groups, current, plan = [], [members[0]], None
    for match in members[1:]:
        joined = _plan([*current, match], order) if len(current) < max_members else None
        if joined is None:
            groups += [plan] if plan is not None else []
            current, plan = [match], None
        else:
            current, plan = [*current, match], joined
    return groups + ([plan] if plan is not None else [])


def _plan(members: list[SkinnyLinear], order: dict[Node, int]) -> SkinnyGroup | None:
    """Where one call of `members` can go, or None (see the module's docstring)."""
    products = {m.product for m in members}
    first, last = members[0].product, members[-1].product
    point = min([user for p in products for user in p.users] + [last.next], key=order.__getitem__)
    if any(_writes(node) for node in _between(first, last)):
        return None
    moved: list[Node] = []
    operands = [members[0].x] + [m.weight for m in members] + [m.bias for m in members if m.bias is not None]
    if not all(_available(node, point, order, products, moved) for node in operands):
        return None
    return SkinnyGroup(tuple(members), point, tuple(moved))


def _available(node: Node, point: Node, order: dict[Node, int], products: set[Node], moved: list[Node]) -> bool:
    """Whether `node` comes before `point` or, a view of such nodes, can be moved there (added to
    `moved` after its inputs). Never a member's product or what reads one."""
    if node in products:
        return False
    if order[node] < order[point] or node in moved:
        return True
    if node.op != "call_function" or node.target not in _MOVABLE_VIEWS:
        return False
    if not all(_available(arg, point, order, products, moved) for arg in node.all_input_nodes):
        return False
    moved.append(node)
    return True


def _between(first: Node, last: Node):
    node = first.next
    while node is not last:
        yield node
        node = node.next


def _writes(node: Node) -> bool:
    """A node that may write to memory (or otherwise must not be reordered against reads)."""
    return node.op == "call_function" and node.is_impure()


def _rewrite(gm: GraphModule, group: SkinnyGroup, target) -> None:
    graph = gm.graph
    for node in group.moved:
        group.point.prepend(node)
    weights = [m.weight for m in group.members]
    biases = [m.bias for m in group.members if m.bias is not None]
    with graph.inserting_before(group.point):
        call = graph.call_function(target, (group.x, weights, biases))
        call.meta.update(_joined_meta(group))
        start = 0
        for m in group.members:
            features = example_value(m.weight).shape[0]
            columns = graph.call_function(_aten.slice.Tensor, (call, 1, start, start + features))
            columns.meta.update(_sliced_meta(m.product, call, start, start + features))
            m.product.replace_all_uses_with(columns)
            start += features
    for m in group.members:
        transpose = m.product.args[-1]
        graph.erase_node(m.product)
        for unused in (transpose, m.x):  # a later member's own reshape of the input
            if not unused.users and unused.op == "call_function" and unused.target in _MOVABLE_VIEWS:
                graph.erase_node(unused)


def _joined_meta(group: SkinnyGroup) -> dict:
    """The first member's meta for the call, with the value of all members' outputs: [1, sum N]."""
    first = example_value(group.members[0].product)
    total = sum(example_value(m.weight).shape[0] for m in group.members)
    return meta_with_value(group.members[0].product, first.new_empty((first.shape[0], total)))


def _sliced_meta(product: Node, call: Node, start: int, end: int) -> dict:
    """`product`'s meta for the slice that replaces it, with the slice's value (its strides are the call's)."""
    return meta_with_value(product, _aten.slice.Tensor(call.meta["val"], 1, start, end))
