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


def _uncast(node):
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
    node = _uncast(node)
    if not is_function(node, {operator.mul, torch.mul}) or len(node.args) != 2:
        return None
    for normalized, scale in (node.args, node.args[::-1]):
        found = _rms_normalized(_uncast(normalized)) if isinstance(normalized, Node) else None
        if found is None:
            continue
        offset, weight = 0.0, _uncast(scale)
        if is_function(weight, {operator.add, torch.add}) and len(weight.args) == 2:
            constant = [a for a in weight.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
            parameter = [_uncast(a) for a in weight.args if isinstance(a, Node)]
            if len(constant) != 1 or len(parameter) != 1:
                continue
            offset, weight = float(constant[0]), parameter[0]
        if isinstance(weight, Node) and weight.op in ("placeholder", "get_attr") and len(shape_of(weight) or ()) == 1:
            return RmsNorm(x=_uncast(found[0]), weight=weight, eps=found[1], offset=offset, out=out)
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


def _fused_part(flat):
    """(source, rows) for one part of a fused projection's output: out[..., a:b] (Phi-3) or out.split(...)[i]
    (GPT-2); else None."""
    if not is_function(flat, {operator.getitem}) or not isinstance(flat.args[0], Node):
        return None
    parent, index = flat.args
    if is_method(parent, {"split"}) and isinstance(index, int):
        size = parent.args[1] if len(parent.args) > 1 else parent.kwargs.get("split_size")
        dim = parent.kwargs.get("dim", parent.args[2] if len(parent.args) > 2 else 0)
        width = (shape_of(parent.args[0]) or (0,))[-1]
        if dim not in (-1, len(shape_of(parent.args[0]) or ()) - 1):
            return None
        sizes = [size] * (width // size) if isinstance(size, int) else list(size)
        start = sum(sizes[:index])
        return parent.args[0], ((start, start + sizes[index]),)
    width = (shape_of(parent) or (0,))[-1]
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice) \
            and index[1].step in (None, 1):
        start, stop, _ = index[1].indices(width)
        return parent, ((start, stop),)
    return None


def _chunked_heads(node):
    """A side's heads of a fused projection split after its heads view: transpose(view(qkv, (b, t, heads,
    parts * head_dim)), 1, 2).chunk(parts, -1)[i] (GPT-NeoX). Returns (source, rows), rows per head, or None."""
    if not is_function(node, {operator.getitem}) or not is_method(node.args[0], {"chunk"}):
        return None
    chunk, index = node.args[0], node.args[1]
    parts = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
    dim = chunk.kwargs.get("dim", chunk.args[2] if len(chunk.args) > 2 else 0)
    transposed = chunk.args[0]
    if dim not in (-1, 3) or not (is_method(transposed, {"transpose"}) and tuple(transposed.args[1:]) in
                                  {(1, 2), (2, 1)}) or not is_method(transposed.args[0], RESHAPE_METHODS):
        return None
    shape = shape_of(transposed)  # [batch, heads, tokens, parts * head_dim]
    if not shape or len(shape) != 4 or shape[-1] % parts:
        return None
    width = shape[-1] // parts
    rows = tuple((head * shape[-1] + index * width, head * shape[-1] + (index + 1) * width)
                 for head in range(shape[1]))
    return transposed.args[0].args[0], rows


def match_head_projection(node) -> Projection | Failed:
    norm = match_rms_norm(node)
    transposed = norm.x if norm else node
    chunked = _chunked_heads(transposed)
    if chunked is not None:
        source = _projection_source(chunked[0])
        if source is None:
            return Failed("the fused projection is not a linear with parameter weights")
        linear, x, weight, bias, conv1d = source
        return Projection(linear=linear, x=x, weight=weight, bias=bias, heads_out=node, out=transposed, norm=norm,
                          rows=chunked[1], conv1d=conv1d, out_layout="heads")
    if not (is_method(transposed, {"transpose"}) and tuple(transposed.args[1:]) in {(1, 2), (2, 1)}):
        return Failed("not a projection split into heads (linear -> view -> transpose)")
    split = transposed.args[0]
    if norm is None:
        norm = match_rms_norm(split)
        split = norm.x if norm else split
    if not is_method(split, RESHAPE_METHODS):
        return Failed("not a projection split into heads (linear -> view -> transpose)")
    flat, rows = split.args[0], None
    source = _projection_source(flat)
    if source is None:
        part = _fused_part(flat)
        if part is None:
            return Failed("the heads come from another operation than a linear projection or a part of a fused one")
        source, rows = _projection_source(part[0]), part[1]
        if source is None:
            return Failed("the fused projection is not a linear with parameter weights")
    linear, x, weight, bias, conv1d = source
    return Projection(linear=linear, x=x, weight=weight, bias=bias, heads_out=node, out=flat, norm=norm, rows=rows,
                      conv1d=conv1d)


def _is_slice_of(node, source, start, stop) -> bool:
    if not (is_function(node, {operator.getitem}) and node.args[0] is source):
        return False
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) != 2 or index[0] is not Ellipsis:
        return False
    sl = index[1]
    return isinstance(sl, slice) and sl.start == start and sl.stop == stop and sl.step in (None, 1)


def is_rotate_half(node, x: Node, head_dim: int) -> bool:
    """cat((-x[..., d/2:], x[..., :d/2]), dim=-1): the rotate-half RoPE form (not the interleaved one)."""
    if not is_function(node, {torch.cat}):
        return False
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if dim not in (-1, 3) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return False
    negated, first_half = parts
    half = head_dim // 2
    return (is_function(negated, {operator.neg, torch.neg})
            and _is_slice_of(negated.args[0], x, half, None)
            and _is_slice_of(first_half, x, None, half))


@dataclass
class Rope:
    """out = x * cos + rotate_half(x) * sin over the first `rotary_dim` channels of x; with partial rotary
    (rotary_dim < head_dim: GPT-NeoX, StableLM, Phi) the rest pass through: out = cat(rotated, x[..., rotary_dim:])."""
    x: Node
    cos: Node
    sin: Node
    out: Node
    rotary_dim: int


def _rotate_half_rope(node) -> Optional[Rope]:
    if not is_function(node, {operator.add, torch.add}) or len(node.args) != 2:
        return None
    for straight, rotated in (node.args, node.args[::-1]):
        if not (is_function(straight, {operator.mul, torch.mul}) and is_function(rotated, {operator.mul, torch.mul})):
            continue
        for x, cos in (straight.args, straight.args[::-1]):
            shape = shape_of(x) if isinstance(x, Node) else None
            if shape is None:
                continue
            for rot, sin in (rotated.args, rotated.args[::-1]):
                if is_rotate_half(rot, x, shape[-1]) and isinstance(cos, Node) and isinstance(sin, Node):
                    return Rope(x=x, cos=cos, sin=sin, out=node, rotary_dim=shape[-1])
    return None


def match_rope(node) -> Optional[Rope]:
    """Rotate-half RoPE over all channels, or over the first ones with the rest concatenated behind (partial)."""
    rope = _rotate_half_rope(node)
    if rope is not None or not is_function(node, {torch.cat}):
        return rope
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if dim not in (-1, 3) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    rope, passed = _rotate_half_rope(parts[0]), parts[1]
    if rope is None or not is_function(rope.x, {operator.getitem}) or not isinstance(rope.x.args[0], Node):
        return None
    whole, width = rope.x.args[0], rope.rotary_dim
    if _is_slice_of(rope.x, whole, None, width) and _is_slice_of(passed, whole, width, None):
        return Rope(x=whole, cos=rope.cos, sin=rope.sin, out=node, rotary_dim=width)
    return None


@dataclass
class RopeSource:
    """Where a RoPE site's cos/sin come from: cos(positions * inv_freq, repeated over both halves) * scale,
    as transformers' rotary embeddings compute them (default, linear, llama3, yarn... all change only inv_freq
    and the scale). A LatentCache stores positions and rebuilds cos/sin from them."""
    positions: Node   # integer [batch|1, tokens]
    inv_freq: Node    # float [head_dim / 2]
    scale: float


_PASS_THROUGH = {"float", "to", "unsqueeze", "expand", "contiguous", "type_as"}


def _strip(node, until=lambda node: False):
    """Look through dtype casts, expands and None-indexing (unsqueezes), stopping at a node where `until` holds."""
    while isinstance(node, Node) and not until(node):
        if is_method(node, _PASS_THROUGH):
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


def match_rope_source(cos: Node, sin: Node):
    """RopeSource of a site's cos/sin operands, or the reason they are not position * inv_freq tables."""
    tables = []
    for node, function in ((cos, "cos"), (sin, "sin")):
        inner, scale = _scaled(_strip(node))
        emb = _trig_argument(_strip(inner), function)
        if emb is None:
            return f"the RoPE {function} table is not {function}(angles) * scale"
        tables.append((_strip(emb), scale))
    (emb, scale), (sin_emb, sin_scale) = tables
    if emb is not sin_emb or scale != sin_scale:
        return "RoPE cos and sin come from different angles or scales"
    parts = emb.args[0] if is_function(emb, {torch.cat}) and emb.args else None
    dim = emb.kwargs.get("dim", emb.args[1] if len(emb.args) > 1 else 0) if parts is not None else None
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is parts[1]
            and dim in (-1, len(shape_of(emb) or ()) - 1)):
        return "RoPE angles are not cat((freqs, freqs), -1) (interleaved or partial rotary)"
    freqs = parts[0]
    if is_method(freqs, {"transpose"}):  # transformers <= 5.17: (inv_freq[None, :, None] @ positions[:, None]).T
        freqs = freqs.args[0]
    if not (is_function(freqs, {operator.mul, torch.mul, operator.matmul, torch.matmul})
            and len(freqs.args) == 2):
        return "RoPE angles are not positions times inv_freq"
    def is_positions(node):
        return _is_integer(node) and len(shape_of(node) or ()) == 2

    first, second = (_strip(arg, is_positions) for arg in freqs.args)
    positions, inv_freq = (first, second) if _is_integer(first) else (second, first)
    inv_shape = shape_of(inv_freq)
    if not _is_integer(positions) or len(shape_of(positions) or ()) != 2 or not inv_shape or len(inv_shape) != 1:
        return "RoPE angles are not integer positions [batch, tokens] times a 1-D inv_freq"
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
