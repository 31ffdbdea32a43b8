"""Small structural matchers over Dynamo FX nodes. Each returns the captured nodes or None.

Architecture differences are data: the tables below list the node targets each pattern accepts.
"""
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

LINEAR_TARGETS = {torch._C._nn.linear, F.linear}
SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
MATMUL_TARGETS = {torch.matmul, operator.matmul}
RESHAPE_METHODS = {"view", "reshape"}
LAYOUT_METHODS = {"view", "reshape", "transpose", "contiguous", "flatten", "permute"}


def is_function(node, targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def is_method(node, names) -> bool:
    return isinstance(node, Node) and node.op == "call_method" and node.target in names


def shape_of(node: Node) -> Optional[tuple]:
    value = node.meta.get("example_value") if isinstance(node, Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def dtype_of(node: Node):
    value = node.meta.get("example_value")
    return value.dtype if isinstance(value, torch.Tensor) else None


@dataclass
class Failed:
    """A match that did not happen, and why (each variant axis's matcher returns its match or this)."""
    reason: str


@dataclass
class RmsNorm:
    """out = x / rms(x) * (offset + weight) over the last axis, computed in float32 (a per-head q/k norm:
    Qwen3's offset 0, Gemma's 1 for its (1 + weight) scale)."""
    x: Node
    weight: Node
    eps: float
    offset: float
    out: Node


_CASTS = {"to", "float", "type_as", "half", "bfloat16"}


def uncast(node):
    """Look through dtype casts (x.to(torch.float32), x.float(), ...)."""
    while is_method(node, _CASTS):
        node = node.args[0]
    return node


def _rms_normalized(node):
    """(x, eps) for x * rsqrt(mean(x ** 2, -1, keepdim=True) + eps) (x possibly cast), else None."""
    if not is_function(node, {operator.mul, torch.mul}) or len(node.args) != 2:
        return None
    for x, inverse in (node.args, node.args[::-1]):
        if not (is_function(inverse, {torch.rsqrt}) or is_method(inverse, {"rsqrt"})):
            continue
        total = inverse.args[0]
        if not is_function(total, {operator.add, torch.add}) or len(total.args) != 2:
            continue
        for mean, eps in (total.args, total.args[::-1]):
            if not isinstance(eps, float) or not (is_method(mean, {"mean"}) or is_function(mean, {torch.mean})):
                continue
            dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
            if dims not in (-1, [-1], (-1,)) or not mean.kwargs.get("keepdim", False):
                continue
            square = mean.args[0]
            if (is_method(square, {"pow"}) or is_function(square, {torch.pow})) and square.args[1:] == (2,) \
                    and square.args[0] is x:
                return x, eps
    return None


def match_rms_norm(node) -> Optional[RmsNorm]:
    """The RMSNorm forms of transformers' per-head q/k norms: weight * normalized(x.float()).to(dtype) (Qwen3,
    Llama's RMSNorm) and (normalized(x.float()) * (1.0 + weight.float())).type_as(x) (Gemma)."""
    out = node
    node = uncast(node)
    if not is_function(node, {operator.mul, torch.mul}) or len(node.args) != 2:
        return None
    for normalized, scale in (node.args, node.args[::-1]):
        found = _rms_normalized(uncast(normalized)) if isinstance(normalized, Node) else None
        if found is None:
            continue
        offset, weight = 0.0, uncast(scale)
        if is_function(weight, {operator.add, torch.add}) and len(weight.args) == 2:
            constant = [a for a in weight.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
            parameter = [uncast(a) for a in weight.args if isinstance(a, Node)]
            if len(constant) != 1 or len(parameter) != 1:
                continue
            offset, weight = float(constant[0]), parameter[0]
        if isinstance(weight, Node) and weight.op in ("placeholder", "get_attr") and len(shape_of(weight) or ()) == 1:
            return RmsNorm(x=uncast(found[0]), weight=weight, eps=found[1], offset=offset, out=out)
    return None


@dataclass
class Projection:
    """One side's projection split into heads [batch, heads, tokens, head_dim]: x W[rows]^T + b[rows], with an
    optional per-head RMSNorm before or after the head transpose (q/k norm). `rows` is None for a projection of
    its own, else the output features it takes of a fused q/k/v projection ((start, stop) ranges; `conv1d`: the
    weight is stored [in, out], GPT-2's Conv1D). The rewrite replaces `out`: the side's own output [batch, tokens,
    heads * head_dim] (`out_layout` "flat"), or, for a fused projection split after its heads view (GPT-NeoX),
    the side's heads [batch, heads, tokens, head_dim] ("heads")."""
    linear: Node      # the (fused) projection: a linear, or a Conv1D's addmm
    x: Node
    weight: Node
    bias: Optional[Node]
    heads_out: Node   # the [batch, heads, tokens, head_dim] node
    out: Node
    norm: Optional[RmsNorm] = None
    rows: Optional[tuple] = None
    conv1d: bool = False
    out_layout: str = "flat"


def _is_parameter(node) -> bool:
    return isinstance(node, Node) and node.op in ("placeholder", "get_attr")


def _projection_source(node):
    """(node, x, weight, bias, conv1d) for linear(x, W, b), or a Conv1D's addmm(b, x.view(-1, in), W) viewed
    back to [..., out]; else None."""
    if is_function(node, LINEAR_TARGETS):
        args = list(node.args) + [None] * (3 - len(node.args))
        weight, bias = node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
        if _is_parameter(weight) and (bias is None or _is_parameter(bias)):
            return node, args[0], weight, bias, False
        return None
    if is_method(node, RESHAPE_METHODS) and is_function(node.args[0], {torch.addmm}):
        addmm = node.args[0]
        bias, flat_x, weight = addmm.args[:3]
        if is_method(flat_x, RESHAPE_METHODS) and _is_parameter(weight) and _is_parameter(bias):
            return addmm, flat_x.args[0], weight, bias, True
    return None


def _last_axis_slice(node, source) -> Optional[slice]:
    """s for source[..., s] or source[:, ..., :, s] (every other axis whole), else None."""
    if not (is_function(node, {operator.getitem}) and node.args[0] is source):
        return None
    index = node.args[1]
    if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
        return None
    leading = index[:-1]
    if leading == (Ellipsis,) or len(index) == len(shape_of(source) or ()) and all(
            part == slice(None) for part in leading):
        return index[-1]
    return None


def _is_slice_of(node, source, start, stop, step=None) -> bool:
    found = _last_axis_slice(node, source)
    return found is not None and found.start == start and found.stop == stop and (found.step or 1) == (step or 1)


def _is_last_axis(dim, node) -> bool:
    return dim in (-1, len(shape_of(node) or ()) - 1)


def _last_axis_part(node):
    """(source, ((start, stop),)) for node = source[..., start:stop] or source.split(...)[i] along the last axis: a part
    of a fused projection's output (Phi-3, GPT-2), or of a cos/sin table (GPT-J); else None."""
    if not is_function(node, {operator.getitem}) or not isinstance(node.args[0], Node):
        return None
    parent, index = node.args
    if (is_method(parent, {"split"}) or is_function(parent, {torch.split})) and isinstance(index, int):
        size = parent.args[1] if len(parent.args) > 1 else parent.kwargs.get("split_size")
        dim = parent.kwargs.get("dim", parent.args[2] if len(parent.args) > 2 else 0)
        shape = shape_of(parent.args[0])
        if not shape or not _is_last_axis(dim, parent.args[0]):
            return None
        width = shape[-1]
        sizes = [size] * (width // size) if isinstance(size, int) else list(size)
        start = sum(sizes[:index])
        return parent.args[0], ((start, start + sizes[index]),)
    columns = _last_axis_slice(node, parent)
    if columns is not None and columns.step in (None, 1) and shape_of(parent):
        start, stop, _ = columns.indices(shape_of(parent)[-1])
        return parent, ((start, stop),)
    return None


def is_head_transpose(node) -> bool:
    """x.transpose(1, 2) or x.permute(0, 2, 1, 3): [batch, tokens, heads, head_dim] <-> [batch, heads, tokens,
    head_dim]."""
    if is_method(node, {"transpose"}):
        return tuple(node.args[1:]) in {(1, 2), (2, 1)}
    if is_method(node, {"permute"}):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        return tuple(dims) == (0, 2, 1, 3)
    return False


def _chunked_heads(node):
    """A side's heads of a fused projection split after its heads view: transpose(view(qkv, (b, t, heads,
    parts * head_dim)), 1, 2).chunk(parts, -1)[i] (GPT-NeoX). Returns (source, rows), rows per head, or None."""
    if not is_function(node, {operator.getitem}) or not is_method(node.args[0], {"chunk"}):
        return None
    chunk, index = node.args[0], node.args[1]
    parts = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
    dim = chunk.kwargs.get("dim", chunk.args[2] if len(chunk.args) > 2 else 0)
    transposed = chunk.args[0]
    if dim not in (-1, 3) or not is_head_transpose(transposed) or not is_method(transposed.args[0], RESHAPE_METHODS):
        return None
    shape = shape_of(transposed)  # [batch, heads, tokens, parts * head_dim]
    if not shape or len(shape) != 4 or shape[-1] % parts:
        return None
    width = shape[-1] // parts
    rows = tuple((head * shape[-1] + index * width, head * shape[-1] + (index + 1) * width)
                 for head in range(shape[1]))
    return transposed.args[0].args[0], rows


def match_head_projection(node, transposed_after: Optional[Node] = None) -> Projection | Failed:
    """The projection whose heads [batch, heads, tokens, head_dim] `node` is. Where the heads are transposed only
    after RoPE (GPT-J), `node` is the [batch, tokens, heads, head_dim] view RoPE turns and `transposed_after` the
    transpose behind it."""
    norm = match_rms_norm(node)
    transposed = norm.x if norm else node
    if transposed_after is not None:
        split, heads_out = transposed, transposed_after
    else:
        chunked = _chunked_heads(transposed)
        if chunked is not None:
            source = _projection_source(chunked[0])
            if source is None:
                return Failed("the fused projection is not a linear with parameter weights")
            linear, x, weight, bias, conv1d = source
            return Projection(linear=linear, x=x, weight=weight, bias=bias, heads_out=node, out=transposed,
                              norm=norm, rows=chunked[1], conv1d=conv1d, out_layout="heads")
        if not is_head_transpose(transposed):
            return Failed("not a projection split into heads (linear -> view -> transpose)")
        split, heads_out = transposed.args[0], node
    if norm is None:
        norm = match_rms_norm(split)
        split = norm.x if norm else split
    if not is_method(split, RESHAPE_METHODS):
        return Failed("not a projection split into heads (linear -> view -> transpose)")
    flat, rows = split.args[0], None
    source = _projection_source(flat)
    if source is None:
        part = _last_axis_part(flat)
        if part is None:
            return Failed("the heads come from another operation than a linear projection or a part of a fused one")
        source, rows = _projection_source(part[0]), part[1]
        if source is None:
            return Failed("the fused projection is not a linear with parameter weights")
    linear, x, weight, bias, conv1d = source
    return Projection(linear=linear, x=x, weight=weight, bias=bias, heads_out=heads_out, out=flat, norm=norm,
                      rows=rows, conv1d=conv1d)


def is_rotate_half(node, x: Node) -> bool:
    """cat((-x[..., d/2:], x[..., :d/2]), dim=-1): rotate-half RoPE's rotation, which turns channels i and i + d/2
    together (transformers' rotate_half)."""
    if not is_function(node, {torch.cat}):
        return False
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if not _is_last_axis(dim, node) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return False
    negated, first_half = parts
    half = shape_of(x)[-1] // 2
    return (is_function(negated, {operator.neg, torch.neg})
            and _is_slice_of(negated.args[0], x, half, None)
            and _is_slice_of(first_half, x, None, half))


def is_rotate_every_two(node, x: Node) -> bool:
    """stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2): interleaved RoPE's rotation, which turns channels
    2i and 2i + 1 together (GPT-J's rotate_every_two)."""
    if not (is_method(node, {"flatten"}) or is_function(node, {torch.flatten})):
        return False
    stacked = node.args[0]
    start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
    end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
    if not is_function(stacked, {torch.stack}) or start not in (-2, len(shape_of(stacked) or ()) - 2) \
            or not _is_last_axis(end, stacked):
        return False
    parts = stacked.args[0] if stacked.args else stacked.kwargs.get("tensors")
    dim = stacked.kwargs.get("dim", stacked.args[1] if len(stacked.args) > 1 else 0)
    if not _is_last_axis(dim, stacked) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return False
    negated, evens = parts
    return (is_function(negated, {operator.neg, torch.neg})
            and _is_slice_of(negated.args[0], x, 1, None, 2)
            and _is_slice_of(evens, x, None, None, 2))


# RoPE's forms: the rotation each applies to x, and whether it turns interleaved channel pairs (2i, 2i + 1)
ROPE_FORMS = ((is_rotate_half, False), (is_rotate_every_two, True))


@dataclass
class Rope:
    """out = x * cos + rotate(x) * sin over the first `rotary_dim` channels of x, rotate one of `ROPE_FORMS`:
    rotate-half (`interleaved` False: channel pairs (i, i + rotary_dim / 2)) or interleaved pairs (2i, 2i + 1)
    (GPT-J). With partial rotary (rotary_dim < head_dim: GPT-NeoX, StableLM, Phi, GPT-J) the rest pass through:
    out = cat(rotated, x[..., rotary_dim:])."""
    x: Node
    cos: Node
    sin: Node
    out: Node
    rotary_dim: int
    interleaved: bool = False


def _full_rope(node) -> Optional[Rope]:
    if not is_function(node, {operator.add, torch.add}) or len(node.args) != 2:
        return None
    for straight, rotated in (node.args, node.args[::-1]):
        if not (is_function(straight, {operator.mul, torch.mul}) and is_function(rotated, {operator.mul, torch.mul})):
            continue
        for x, cos in (straight.args, straight.args[::-1]):
            shape = shape_of(x) if isinstance(x, Node) else None
            if shape is None or not isinstance(cos, Node):
                continue
            for rot, sin in (rotated.args, rotated.args[::-1]):
                for is_rotation, interleaved in ROPE_FORMS:
                    if isinstance(sin, Node) and is_rotation(rot, x):
                        return Rope(x=x, cos=cos, sin=sin, out=node, rotary_dim=shape[-1], interleaved=interleaved)
    return None


def match_rope(node) -> Optional[Rope]:
    """RoPE (any of `ROPE_FORMS`) over all channels, or over the first ones with the rest concatenated behind
    (partial)."""
    rope = _full_rope(node)
    if rope is not None or not is_function(node, {torch.cat}):
        return rope
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if not _is_last_axis(dim, node) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    rope, passed = _full_rope(parts[0]), parts[1]
    if rope is None or not is_function(rope.x, {operator.getitem}) or not isinstance(rope.x.args[0], Node):
        return None
    whole, width = rope.x.args[0], rope.rotary_dim
    if _is_slice_of(rope.x, whole, None, width) and _is_slice_of(passed, whole, width, None):
        return Rope(x=whole, cos=rope.cos, sin=rope.sin, out=node, rotary_dim=width, interleaved=rope.interleaved)
    return None


@dataclass
class RopeSource:
    """Where a RoPE site's cos/sin come from, at integer `positions` [batch|1, tokens], times `scale`: computed,
    cos(positions * inv_freq) as transformers' rotary embeddings do (default, linear, llama3, yarn... all change only
    inv_freq and the scale), or read, the rows of the model's own table at the positions (`table` [max_positions,
    width] with cos in columns `cos_columns` and sin in `sin_columns`: GPT-J's embed_positions). A LatentCache stores
    positions and rebuilds cos/sin from them. Where the frequencies change while the model runs (`rows`: cos/sin
    are inputs of the graph, computed before a graph break, or come from an inv_freq the graph itself overwrites;
    see `lrkv_compile/rotary.py`), positions are not enough: a LatentCache stores each token's cos/sin rows."""
    positions: Optional[Node]        # integer [batch|1, tokens]; None for `rows`
    inv_freq: Optional[Node]         # float [rotary_dim / 2]; None where cos/sin are read from `table` or are `rows`
    scale: float
    table: Optional[Node] = None     # float [max_positions, width]
    cos_columns: tuple = ()          # (start, stop) of rotary_dim / 2 columns of the table
    sin_columns: tuple = ()
    rows: bool = False               # the site's own cos/sin are what a LatentCache stores per token


def _updated_in_graph(node: Node) -> bool:
    """Whether the graph writes `node` in place (transformers' longrope copies its new frequencies into inv_freq)."""
    return any(is_method(user, {"copy_"}) and user.args[0] is node for user in node.users)


_PASS_THROUGH = {"float", "to", "unsqueeze", "expand", "contiguous", "type_as"}


def _is_broadcast_repeat(node) -> bool:
    """x.repeat(...) tiling only new or size-1 axes of x: the values of an expand."""
    if not is_method(node, {"repeat"}) or len(node.args) < 2:
        return False
    repeats = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
    shape = shape_of(node.args[0])
    if shape is None or len(repeats) < len(shape):
        return False
    shape = (1,) * (len(repeats) - len(shape)) + tuple(shape)
    return all(repeat == 1 or size == 1 for repeat, size in zip(repeats, shape))


def _strip(node, until=lambda node: False):
    """Look through dtype casts, expands (and repeats that only broadcast) and None-indexing (unsqueezes), stopping
    at a node where `until` holds."""
    while isinstance(node, Node) and not until(node):
        if is_method(node, _PASS_THROUGH) or _is_broadcast_repeat(node):
            node = node.args[0]
        elif is_function(node, {operator.getitem}) and isinstance(node.args[1], tuple) and all(
                part is None or part is Ellipsis or part == slice(None) for part in node.args[1]):
            node = node.args[0]
        else:
            break
    return node


def _trig_argument(node, function: str):
    """x for cos(x) / sin(x) (method or torch function), else None."""
    if is_method(node, {function}) or is_function(node, {getattr(torch, function)}):
        return node.args[0]
    return None


def _scaled(node):
    """(inner, scale) for inner * constant (the rotary attention scaling), else (node, 1.0)."""
    if is_function(node, {operator.mul, torch.mul}) and len(node.args) == 2:
        for inner, scale in (node.args, node.args[::-1]):
            if isinstance(inner, Node) and isinstance(scale, (int, float)) and not isinstance(scale, bool):
                return inner, float(scale)
    return node, 1.0


def _is_integer(node) -> bool:
    dtype = dtype_of(node) if isinstance(node, Node) else None
    return dtype is not None and not dtype.is_floating_point and dtype != torch.bool


def _is_positions(node) -> bool:
    return _is_integer(node) and len(shape_of(node) or ()) == 2


def _doubled(node, interleaved: bool):
    """h for a half-width table h doubled over the channel pairs RoPE turns together: cat((h, h), -1) for rotate-half
    RoPE, repeat_interleave(h, 2, -1) for interleaved pairs; else None."""
    node = _strip(node)
    if interleaved:
        if not (is_function(node, {torch.repeat_interleave}) or is_method(node, {"repeat_interleave"})):
            return None
        args = list(node.args) + [None] * 2
        repeats, dim = node.kwargs.get("repeats", args[1]), node.kwargs.get("dim", args[2])
        return node.args[0] if repeats == 2 and dim is not None and _is_last_axis(dim, node) else None
    parts = node.args[0] if is_function(node, {torch.cat}) and node.args else None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0) if parts is not None else None
    if isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is parts[1] and _is_last_axis(dim, node):
        return parts[0]
    return None


def _table_rows(node):
    """(table, (start, stop), positions) for columns [start, stop) of the rows of a 2-D table at integer positions
    [batch, tokens]: table[positions] or gather(table.repeat(batch, 1, 1), 1, positions[..., None].repeat(1, 1,
    width)), split or sliced (GPT-J's embed_positions, sin | cos); else None."""
    part = _last_axis_part(_strip(node))
    if part is None or len(part[1]) != 1:
        return None
    rows = _strip(part[0])
    if is_function(rows, {operator.getitem}) and len(rows.args) == 2 and isinstance(rows.args[1], Node):
        source, index = rows.args  # table[positions] (transformers >= 5.24)
    elif is_function(rows, {torch.gather}) and len(rows.args) == 3 and not rows.kwargs and rows.args[1] in (1, -2):
        source, _, index = rows.args
    else:
        return None
    table, positions = _strip(source), _strip(index, _is_positions)
    if len(shape_of(table) or ()) != 2 or not _is_positions(positions):
        return None
    return table, part[1][0], positions


def _trace_table(node, function: str, interleaved: bool):
    """One of a site's cos/sin operands [..., rotary_dim], traced to its source: ("angles", freqs, scale) for
    function(angles) * scale, each frequency's angle doubled over RoPE's channel pairs (`_doubled`); ("table", rows,
    scale) for `_table_rows` doubled so; else the reason (a string)."""
    inner, scale = _scaled(_strip(node))
    half = _doubled(inner, interleaved)
    if half is not None:  # a value per frequency, then doubled (GPT-J)
        rows = _table_rows(half)
        if rows is not None:
            return "table", rows, scale
        freqs = _trig_argument(_strip(half), function)
    else:  # the angles doubled, then cos/sin (transformers' rotary embeddings)
        angles = _trig_argument(_strip(inner), function)
        freqs = None if angles is None else _doubled(angles, interleaved)
    if freqs is None:
        pairs = "interleaved (repeat_interleave(h, 2, -1))" if interleaved else "rotate-half (cat((h, h), -1))"
        return (f"the RoPE {function} table is neither {function}(angles) * scale nor rows of a table, doubled over "
                f"{pairs} channel pairs")
    return "angles", _strip(freqs), scale


def match_rope_source(cos: Node, sin: Node, interleaved: bool = False):
    """RopeSource of a site's cos/sin operands (each frequency doubled as the `interleaved` or rotate-half form of
    RoPE pairs channels), or the reason they are neither position * inv_freq tables nor a table's rows nor inputs of
    the graph."""
    if all(_strip(node).op == "placeholder" for node in (cos, sin)):
        if interleaved:
            return "interleaved RoPE's cos/sin are inputs of the graph"
        return RopeSource(positions=None, inv_freq=None, scale=1.0, rows=True)
    traced = [_trace_table(node, function, interleaved) for node, function in ((cos, "cos"), (sin, "sin"))]
    for found in traced:
        if isinstance(found, str):
            return found
    (kind, source, scale), (sin_kind, sin_source, sin_scale) = traced
    if kind != sin_kind or scale != sin_scale:
        return "RoPE cos and sin come from different sources or scales"
    if kind == "table":
        (table, cos_columns, positions), (sin_table, sin_columns, sin_positions) = source, sin_source
        if table is not sin_table or positions is not sin_positions:
            return "RoPE cos and sin are read from different tables or at different positions"
        return RopeSource(positions=positions, inv_freq=None, scale=scale, table=table, cos_columns=cos_columns,
                          sin_columns=sin_columns)
    freqs = source
    if freqs is not sin_source:
        return "RoPE cos and sin come from different angles"
    if is_method(freqs, {"transpose"}):  # transformers <= 5.17: (inv_freq[None, :, None] @ positions[:, None]).T
        freqs = freqs.args[0]
    if not (is_function(freqs, {operator.mul, torch.mul, operator.matmul, torch.matmul})
            and len(freqs.args) == 2):
        return "RoPE angles are not positions times inv_freq"
    first, second = (_strip(arg, _is_positions) for arg in freqs.args)
    positions, inv_freq = (first, second) if _is_integer(first) else (second, first)
    inv_shape = shape_of(inv_freq)
    if not _is_positions(positions) or not inv_shape or len(inv_shape) != 1:
        return "RoPE angles are not integer positions [batch, tokens] times a 1-D inv_freq"
    if _updated_in_graph(inv_freq):
        if interleaved:
            return "interleaved RoPE's frequencies are overwritten inside the graph"
        return RopeSource(positions=None, inv_freq=None, scale=1.0, rows=True)
    return RopeSource(positions=positions, inv_freq=inv_freq, scale=scale)


def follow_layout_chain(node: Node) -> tuple[list[Node], Optional[Node]]:
    """From an attention output, walk single-user reshapes/transposes to the linear that consumes them.

    Returns (chain, linear) with linear None where the chain does not end in a linear's input.
    """
    chain, current = [], node
    while len(current.users) == 1:
        user = next(iter(current.users))
        if is_method(user, LAYOUT_METHODS) and user.args[0] is current:
            chain.append(user)
            current = user
            continue
        if is_function(user, LINEAR_TARGETS) and user.args[0] is current:
            return chain, user
        break
    return chain, None


def unwrap_slot_crop(node):
    """x[:, :, :n] (or x[:, :, :n, :]) -> x: transformers' SDPA integration crops keys and values to the
    query length when a prefill into an empty preallocated cache runs with is_causal=True and no mask.
    A latent site attends over exactly the slots written so far, which is that prefix."""
    if not is_function(node, {operator.getitem}) or not isinstance(node.args[0], Node):
        return node
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) not in (3, 4):
        return node
    full = slice(None, None, None)
    crop = index[2]
    if index[:2] != (full, full) or index[3:] not in ((), (full,)):
        return node
    if isinstance(crop, slice) and crop.start in (None, 0) and crop.step in (None, 1) and crop.stop is not None:
        return node.args[0]
    return node


def unwrap_repeat_kv(node):
    """x[:, :, None].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d) -> x (transformers' repeat_kv)."""
    if not is_method(node, RESHAPE_METHODS):
        return node
    expanded = node.args[0]
    if not is_method(expanded, {"expand"}):
        return node
    indexed = expanded.args[0]
    if not is_function(indexed, {operator.getitem}):
        return node
    index = indexed.args[1]
    if isinstance(index, tuple) and len(index) == 5 and index[2] is None:
        return indexed.args[0]
    return node
