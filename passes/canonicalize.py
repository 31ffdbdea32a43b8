"""Canonicalize a Dynamo graph before matching: rewrite forms that compute the same thing into one form, so the
matchers see the same graph whatever way a model (or a compiler before us) wrote it.

Each rule is a (name, rewrite) pair; a rewrite looks at one node and, if its pattern holds, replaces that node's
uses by an equal value and returns True. `canonicalize` applies the table until no rule fires (tinygrad's
`PatternMatcher` in spirit). Every rule is exact: it removes an identity, or undoes a split or a fusion of a
linear map, so the rewritten graph computes the same values.
"""
import operator

import torch
from torch.fx import GraphModule, Node

from .patterns import LINEAR_TARGETS, is_function, is_method, shape_of

_IDENTITY_CASTS = {"to", "type", "type_as", "float", "half", "bfloat16"}


def _value(node):
    value = node.meta.get("example_value") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _same_tensor_type(node: Node, source) -> bool:
    out, given = _value(node), _value(source)
    return out is not None and given is not None and out.dtype == given.dtype and out.device == given.device \
        and out.shape == given.shape


def _writes_in_place(node: Node) -> bool:
    """A user that may write into its input: dropping a copy before it would change what it writes."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.startswith("_")


def _replace(node: Node, by) -> bool:
    node.replace_all_uses_with(by)
    node.graph.erase_node(node)
    return True


def no_op_cast(node: Node) -> bool:
    """x.to(x.dtype), x.float() on float32, x.type_as(y) of the same dtype: x itself."""
    if not is_method(node, _IDENTITY_CASTS) or not _same_tensor_type(node, node.args[0]):
        return False
    return not node.kwargs.get("copy", False) and _replace(node, node.args[0])


def no_op_reshape(node: Node) -> bool:
    """x.view(x.shape) or x.reshape(x.shape): x itself."""
    if not is_method(node, {"view", "reshape"}) or not _same_tensor_type(node, node.args[0]):
        return False
    return _replace(node, node.args[0])


_SAME_MEMORY = {"view", "reshape", "contiguous", "to", "type", "type_as", "float", "half", "bfloat16"}


def _same_memory_users(node: Node):
    """The nodes that may read `node`'s memory as it is laid out: its users through shape and dtype methods
    (which return `node` itself or a view of it when they can), transitively; None if one of them writes in place."""
    found, frontier = [], list(node.users)
    while frontier:
        user = frontier.pop()
        if _writes_in_place(user):
            return None
        if user not in found:
            found.append(user)
            if is_method(user, _SAME_MEMORY):
                frontier.extend(user.users)
    return found


def contiguous(node: Node) -> bool:
    """x.contiguous(): x, where nothing downstream writes in place; every `view` that would read x's memory
    (directly or through other shape methods) becomes `reshape`, which copies exactly when the view would fail."""
    if not is_method(node, {"contiguous"}):
        return False
    readers = _same_memory_users(node)
    if readers is None:
        return False
    for reader in readers:
        if is_method(reader, {"view"}):
            reader.target = "reshape"
    return _replace(node, node.args[0])


def _erase_unused(nodes) -> None:
    """Erase the nodes (the operands of a rewritten pattern) that nothing reads any more."""
    for node in nodes:
        if isinstance(node, Node) and node.op == "call_function" and not node.users and not node._erased:
            node.graph.erase_node(node)


def _row_slice(node):
    """(tensor, start, stop) of `tensor[a:b]` (rows of a weight or bias), else None."""
    if not is_function(node, {operator.getitem}) or not isinstance(node.args[1], slice):
        return None
    piece = node.args[1]
    rows = shape_of(node.args[0])
    if piece.step not in (None, 1) or rows is None:
        return None
    start, stop, _ = piece.indices(rows[0])
    return node.args[0], start, stop


def _covers(pieces) -> bool:
    """The row slices are of one tensor, consecutive, and cover all its rows."""
    if any(piece is None for piece in pieces) or len({piece[0] for piece in pieces}) != 1:
        return False
    stops = [0] + [piece[2] for piece in pieces]
    return all(piece[1] == stop for piece, stop in zip(pieces, stops)) and stops[-1] == shape_of(pieces[0][0])[0]


def split_linear(node: Node) -> bool:
    """cat([x W[a:b]^T + bias[a:b], x W[b:c]^T + bias[b:c], ...], -1) over all rows of W: x W^T + bias."""
    if not is_function(node, {torch.cat}) or not node.args or not isinstance(node.args[0], (list, tuple)):
        return False
    parts, dim = node.args[0], node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if len(parts) < 2 or not all(is_function(part, LINEAR_TARGETS) and len(part.users) == 1 for part in parts):
        return False
    ndim = len(shape_of(node) or ())
    if dim not in (-1, ndim - 1) or len({part.args[0] for part in parts}) != 1:
        return False
    weights = [_row_slice(part.args[1]) for part in parts]
    biases = [part.args[2] if len(part.args) > 2 else part.kwargs.get("bias") for part in parts]
    if not _covers(weights):
        return False
    if all(bias is None for bias in biases):
        bias = None
    elif _covers([_row_slice(bias) for bias in biases]):
        bias = _row_slice(biases[0])[0]
    else:
        return False
    with node.graph.inserting_before(node):
        whole = node.graph.call_function(parts[0].target, (parts[0].args[0], weights[0][0], bias))
    whole.meta.update(node.meta)
    graph, operands = node.graph, [part.args[1] for part in parts] + biases
    _replace(node, whole)
    for part in parts:
        graph.erase_node(part)
    _erase_unused(operands)
    return True


def _concatenated(node):
    """The tensors of `torch.cat(tensors, 0)`, else None."""
    if not is_function(node, {torch.cat}) or not isinstance(node.args[0], (list, tuple)):
        return None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return list(node.args[0]) if dim == 0 else None


def fused_linear(node: Node) -> bool:
    """split(x cat(W1, W2, ...)^T + cat(b1, b2, ...), [n1, n2, ...], -1)[i] = x Wi^T + bi: projections fused by
    concatenating their weights at run time, read apart again."""
    if not is_function(node, {operator.getitem}) or not isinstance(node.args[1], int):
        return False
    split = node.args[0]
    if not (is_function(split, {torch.split}) or is_method(split, {"split"})):
        return False
    linear = split.args[0]
    if not is_function(linear, LINEAR_TARGETS) or len(linear.users) != 1:
        return False
    weights = _concatenated(linear.args[1])
    bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    biases = [None] * len(weights or ()) if bias is None else _concatenated(bias)
    sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size_or_sections")
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    ndim = len(shape_of(linear) or ())
    if weights is None or biases is None or len(biases) != len(weights) or dim not in (-1, ndim - 1) \
            or not isinstance(sizes, (list, tuple)) or [shape_of(weight)[0] for weight in weights] != list(sizes):
        return False
    for index, getter in [(user.args[1], user) for user in list(split.users)]:
        if not is_function(getter, {operator.getitem}) or not isinstance(index, int):
            return False
    for getter in list(split.users):
        index = getter.args[1]
        with node.graph.inserting_before(getter):
            part = node.graph.call_function(linear.target, (linear.args[0], weights[index], biases[index]))
        part.meta.update(getter.meta)
        _replace(getter, part)
    operands = [linear.args[1], bias]
    node.graph.erase_node(split)
    node.graph.erase_node(linear)
    _erase_unused(operands)
    return True


RULES = (
    ("no-op cast", no_op_cast),
    ("no-op reshape", no_op_reshape),
    ("contiguous", contiguous),
    ("split linear", split_linear),
    ("fused linear", fused_linear),
)


def canonicalize(gm: GraphModule) -> dict:
    """Apply `RULES` to every node until none fires; returns how often each rule fired."""
    fired = {name: 0 for name, _ in RULES}
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node._erased:  # removed by an earlier rule in this sweep
                continue
            for name, rule in RULES:
                if node.op in ("call_function", "call_method") and rule(node):
                    fired[name] += 1
                    changed = True
                    break
    if any(fired.values()):
        gm.graph.lint()
        gm.recompile()
    return fired
