"""Find every attention site of a Dynamo FX graph by structure, one record per site.

A site is matched one variant axis at a time, each matcher returning its typed match or a `Failed` with the
reason: attention (SDPA with or without GQA, or eager softmax attention, soft-capped or not), cache (none, a
stock concat or preallocated cache, or the lrkv latent cache marker), projection (a linear, a Conv1D, or a part
of a fused q/k/v projection, bias optional), key chain (an optional per-head RMSNorm before or after the head
transpose, then RoPE, rotate-half or interleaved, over all or the first channels, before or after the head
transpose, or none) and the value projection. The output projection behind SDPA is recorded when there is one.
Anything else is left alone and reported with the reason.
"""
import operator
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from lrkv_compile.signature import SiteSignature
from lrkv_compile.weights import weight_name
from .patterns import (MATMUL_TARGETS, SDPA_TARGETS, Failed, RopeSource, follow_layout_chain, is_function,
                       is_head_transpose, is_method, match_head_projection, match_rope, match_rope_source, shape_of,
                       uncast, unwrap_repeat_kv, unwrap_slot_crop)

CACHE_MARKER = "lrkv.cache_marker"


@dataclass
class AttentionSite:
    index: int                      # order of execution among matched sites
    layer: Optional[int]            # the model's layer index (the LatentCache's, else from the weight's name)
    sdpa: Node
    query: Node
    key: object                     # patterns.Projection
    value: object
    rope: Optional[object]           # RoPE on the new keys, None for models without it
    rope_source: Optional[RopeSource]  # the positions and frequencies its cos/sin come from (latent sites: always)
    cache: str                      # "none" | "concat" | "static" (stock caches) | "latent"
    cache_nodes: tuple = ()         # concat: (cat_k, cat_v); static: (write_k, write_v); latent: (marker,)
    k_weight: str = ""
    v_weight: str = ""
    k_bias: Optional[str] = None
    v_bias: Optional[str] = None
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    scale: Optional[float] = None
    softcap: float = 0.0            # scores soft-capped to cap * tanh(scores / cap) (0: not capped)
    attn_mask: Optional[Node] = None
    out_chain: list = field(default_factory=list)
    out_proj: Optional[Node] = None

    @property
    def signature(self) -> SiteSignature:
        return SiteSignature(self.k_weight, self.v_weight, self.hidden_size, self.num_kv_heads,
                             self.head_dim)


@dataclass
class Unmatched:
    node: str
    reason: str


_SOURCE_PART = re.compile(r"\._(modules|parameters|buffers)\['([^']*)'\]")
_PLACEHOLDER_PART = re.compile(r"_(modules|parameters|buffers)_")
_PLACEHOLDER_ROOT = re.compile(r"l_(?:self|args_\d+)(_(?:modules|parameters|buffers)_.*)_")


def parameter_name(node: Node) -> Optional[str]:
    """The model's name of the parameter or buffer a placeholder holds, e.g. model.layers.0.self_attn.k_proj.weight,
    read from Dynamo's source of it (L['self']._modules['model']...._parameters['weight'], where the root is
    L['self'] or, when the forward is wrapped by a decorator, L['args'][0]), else from the placeholder's name
    (l_self_modules_model_..._parameters_weight_, or l_args_0_modules_...)."""
    if node.op != "placeholder":
        return None
    source = getattr(node.meta.get("grapharg"), "source", None)
    text = getattr(source, "name", None)
    text = text() if callable(text) else text
    if isinstance(text, str):
        parts = _SOURCE_PART.findall(text)
        if parts and parts[-1][0] in ("parameters", "buffers"):
            return ".".join(name for _, name in parts)
        return None
    root = _PLACEHOLDER_ROOT.fullmatch(node.name)
    if root is None:
        return None
    parts = _PLACEHOLDER_PART.split(root.group(1))
    # parts = ['', 'modules', 'model', 'modules', 'layers', ..., 'parameters', 'weight']
    if len(parts) < 3 or parts[0] != "" or parts[-2] not in ("parameters", "buffers"):
        return None
    return ".".join(parts[2::2])


def _split_cache(node: Node):
    """Returns (kind, new_tensor, cache_nodes) for the K or V operand of SDPA."""
    if is_function(node, {operator.getitem}) and isinstance(node.args[0], Node):
        marker = node.args[0]
        if marker.op == "call_function" and str(marker.target).startswith(CACHE_MARKER):
            index = node.args[1]  # 0: keys, 1: values
            name = ("key_states", "value_states")[index]
            new = marker.kwargs[name] if name in marker.kwargs else marker.args[index]
            return "latent", new, (marker,)
    if is_function(node, {torch.cat}):
        parts = node.args[0]
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        if isinstance(parts, (list, tuple)) and len(parts) == 2 and dim in (-2, 2):
            return "concat", parts[1], (node,)
    if isinstance(node, Node):  # a preallocated stock cache (StaticLayer): buffer.index_copy_(2, slots, new)
        writes = [user for user in node.users if is_method(user, {"index_copy_"}) and user.args[0] is node
                  and user.args[1] in (2, -2) and len(user.args) == 4]
        if len(writes) == 1:
            return "static", writes[0].args[3], (writes[0],)
    return "none", node, ()


@dataclass
class Attention:
    """The attention axis: SDPA's operands and settings, or those of an eager softmax(q k^T * scale + mask) v
    (whose scores may be soft-capped: cap * tanh(scores / cap), Gemma 2)."""
    query: Node
    key: Node
    value: Node
    mask: Optional[Node]
    scale: Optional[float]
    is_causal: bool
    enable_gqa: bool
    softcap: float = 0.0


def match_attention(node: Node) -> Attention | Failed:
    if is_function(node, MATMUL_TARGETS):
        return match_eager_attention(node)
    args = list(node.args) + [None] * 6
    query, key, value = (node.kwargs.get(k, args[i]) for i, k in enumerate(("query", "key", "value")))
    if node.kwargs.get("dropout_p", args[4] or 0.0) != 0.0:
        return Failed("attention dropout is on (a model in training mode); call model.eval()")
    return Attention(query, key, value, node.kwargs.get("attn_mask", args[3]), node.kwargs.get("scale"),
                     bool(node.kwargs.get("is_causal", args[5])), bool(node.kwargs.get("enable_gqa", False)))


def _constant_factor(node, targets):
    """(inner, constant) for inner <op> constant with op in targets, else (node, None)."""
    if is_function(node, targets) and len(node.args) == 2 and isinstance(node.args[1], (int, float)) \
            and not isinstance(node.args[1], bool):
        return node.args[0], float(node.args[1])
    return node, None


def match_eager_attention(out: Node) -> Attention | Failed:
    """matmul(dropout(softmax(scores + mask).to(dtype)), v) with scores = q @ k.transpose(2, 3) * scale, optionally
    soft-capped (transformers' eager_attention_forward), q and k possibly cast first (GPT-J scores in float32)."""
    weights, value = out.args[0], out.args[1]
    if is_function(weights, {F.dropout}):
        args = list(weights.args) + [None] * 3
        p = weights.kwargs.get("p", 0.5 if args[1] is None else args[1])
        training = weights.kwargs.get("training", True if args[2] is None else args[2])
        if training and p != 0.0:
            return Failed("attention dropout is on (a model in training mode); call model.eval()")
        weights = weights.args[0]
    while is_method(weights, {"to", "type_as"}):
        weights = weights.args[0]
    if not (is_function(weights, {F.softmax, torch.softmax}) or is_method(weights, {"softmax"})):
        return Failed("not attention: a matmul whose left operand is not softmax weights")
    dim = weights.kwargs.get("dim", weights.args[1] if len(weights.args) > 1 else None)
    if dim not in (-1, 3):
        return Failed("softmax over another axis than the keys")
    scores, mask = weights.args[0], None
    if is_function(scores, {operator.add, torch.add}) and len(scores.args) == 2:
        scores, mask = scores.args
    softcap = 0.0
    capped, cap = _constant_factor(scores, {operator.mul, torch.mul})
    if cap is not None and (is_function(capped, {torch.tanh}) or is_method(capped, {"tanh"})):
        inner, divisor = _constant_factor(capped.args[0], {operator.truediv, torch.div})
        if divisor != cap:
            return Failed("attention scores are capped by tanh with mismatched constants")
        scores, softcap = inner, cap
    product, scale = _constant_factor(scores, {operator.mul, torch.mul})
    if scale is None:  # scores / sqrt(head_dim) (GPT-J)
        product, divisor = _constant_factor(scores, {operator.truediv, torch.div})
        scale = None if divisor is None else 1.0 / divisor
    if not is_function(product, MATMUL_TARGETS):
        return Failed("attention scores are not q @ k^T times a constant scale")
    query, keys = product.args
    if not (is_method(keys, {"transpose"}) and tuple(keys.args[1:]) in {(2, 3), (3, 2), (-1, -2), (-2, -1)}):
        return Failed("attention scores are not q @ k^T (keys not transposed on their last two axes)")
    return Attention(uncast(query), uncast(keys.args[0]), value, mask, scale if scale is not None else 1.0, False,
                     False, softcap)


@dataclass
class CacheMatch:
    """The cache axis: none, a stock concat cache or the LatentCache marker, between the new K/V and SDPA."""
    kind: str          # "none" | "concat" | "static" | "latent"
    new_k: Node
    new_v: Node
    nodes: tuple       # concat: (cat_k, cat_v); static: (write_k, write_v); latent: (marker,)
    cropped: bool      # keys/values cropped to the query length (transformers' SDPA path, empty static cache)
    repeated: bool     # K/V repeated per query head (repeat_kv)


def match_cache(key: Node, value: Node, is_causal: bool) -> CacheMatch | Failed:
    cropped = unwrap_slot_crop(key) is not key
    if cropped != (unwrap_slot_crop(value) is not value):
        return Failed("keys and values are cropped to different slots")
    key, value = unwrap_slot_crop(key), unwrap_slot_crop(value)
    repeated = unwrap_repeat_kv(key) is not key
    k_kind, new_k, k_nodes = _split_cache(unwrap_repeat_kv(key))
    v_kind, new_v, v_nodes = _split_cache(unwrap_repeat_kv(value))
    if k_kind != v_kind:
        return Failed(f"keys and values use different caches ({k_kind} / {v_kind})")
    if k_kind == "latent" and is_causal and not cropped:
        # SDPA's is_causal aligns the causal mask top-left; the latent attention aligns it to the newest slot.
        # The two agree only when keys are cropped to the queries (a prefill into an empty cache).
        return Failed("is_causal=True over a cache longer than the queries (top-left aligned causal mask)")
    if k_kind == "latent" and k_nodes[0] is not v_nodes[0]:
        return Failed("keys and values come from different LatentCache updates")
    return CacheMatch(k_kind, new_k, new_v, k_nodes if k_kind == "latent" else k_nodes + v_nodes, cropped, repeated)


@dataclass
class KeyChain:
    """The key chain axis: head projection, optional per-head RMSNorm (in `projection.norm`), optional RoPE, which
    turns [batch, heads, tokens, head_dim] keys or, where the heads are transposed after it (`tokens_first`, GPT-J),
    [batch, tokens, heads, head_dim] ones."""
    projection: object  # patterns.Projection
    rope: Optional[object]  # patterns.Rope
    tokens_first: bool = False


def match_key_chain(new_k: Node) -> KeyChain | Failed:
    rope, transposed_after = match_rope(new_k), None
    if rope is None and is_head_transpose(new_k):
        rope = match_rope(new_k.args[0])
        transposed_after = new_k if rope else None
    projection = match_head_projection(rope.x if rope else new_k, transposed_after)
    if isinstance(projection, Failed):
        where = "under RoPE" if rope else "(no RoPE, rotate-half or interleaved, full or partial, found on them)"
        return Failed(f"keys {where}: {projection.reason}; other key layouts are not supported")
    return KeyChain(projection, rope, tokens_first=transposed_after is not None)


def match_value_projection(new_v: Node):
    projection = match_head_projection(new_v)
    if isinstance(projection, Failed):
        return Failed(f"values: {projection.reason}")
    if projection.norm is not None:
        return Failed("values are normalized per head (a v norm), which a latent value path cannot absorb")
    return projection


def _weight_name(projection, name_of) -> Optional[str]:
    """The plan's name of a projection's weight (`lrkv_compile.weights`): the parameter's, with the rows of a fused
    projection, or all columns of a Conv1D weight stored [in, out]."""
    parameter = name_of(projection.weight)
    rows = projection.rows
    if parameter is None:
        return None
    if rows is None and projection.conv1d:
        rows = ((0, shape_of(projection.weight)[1]),)
    return weight_name(parameter, rows, projection.conv1d)


def _layer_of(k_weight: str) -> Optional[int]:
    """The model's layer index in a parameter name: its first integer component (model.layers.3.self_attn...)."""
    return next((int(part) for part in k_weight.split(".") if part.isdigit()), None)


def _match_one(sdpa: Node, name_of: Callable[[Node], Optional[str]]):
    attention = match_attention(sdpa)
    if isinstance(attention, Failed):
        return attention.reason
    cache = match_cache(attention.key, attention.value, attention.is_causal)
    if isinstance(cache, Failed):
        return cache.reason
    chain = match_key_chain(cache.new_k)
    if isinstance(chain, Failed):
        return chain.reason
    key, rope = chain.projection, chain.rope
    value = match_value_projection(cache.new_v)
    if isinstance(value, Failed):
        return value.reason
    if key.x is not value.x:
        return "K and V projections read different inputs"
    query = attention.query
    q_shape, k_shape, v_shape = shape_of(query), shape_of(key.heads_out), shape_of(value.heads_out)
    if not (q_shape and k_shape and v_shape) or len(q_shape) != 4:
        return "missing shape metadata on q/k/v"
    if k_shape[-1] != v_shape[-1] or k_shape[1] != v_shape[1]:
        return "K and V have different head layouts"
    rope_source = None
    if rope is not None:
        cos_shape, heads_axis = shape_of(rope.cos), 2 if chain.tokens_first else 1
        if cos_shape is None or len(cos_shape) != 4 or cos_shape[heads_axis] != 1 or cos_shape[-1] != rope.rotary_dim:
            layout = "tokens, 1" if chain.tokens_first else "1, tokens"
            return f"RoPE tables are not [batch, {layout}, rotary_dim]"
        rope_source = match_rope_source(rope.cos, rope.sin, rope.interleaved)
        if isinstance(rope_source, str):
            if cache.kind == "latent":  # a LatentCache stores positions, not RoPE rows: it needs their source
                return f"{rope_source}, so a LatentCache cannot rebuild RoPE from stored positions"
            rope_source = None  # a stock cache (or none) keeps full keys: the factored rewrite needs no source
    num_heads, num_kv_heads = q_shape[1], k_shape[1]
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    if num_heads != num_kv_heads and not (cache.repeated or attention.enable_gqa):
        return "query and KV head counts differ but SDPA neither repeats K/V nor sets enable_gqa"
    k_weight, v_weight = (_weight_name(projection, name_of) for projection in (key, value))
    if not k_weight or not v_weight:
        return "cannot name the K/V weight parameters"
    chain, out_proj = follow_layout_chain(sdpa)
    if cache.kind == "latent":
        marker = cache.nodes[0]
        layer = marker.kwargs["layer_idx"] if "layer_idx" in marker.kwargs else marker.args[-1]
    else:
        layer = _layer_of(k_weight)
    return AttentionSite(
        index=-1, layer=layer, sdpa=sdpa, query=query, key=key, value=value, rope=rope, rope_source=rope_source,
        cache=cache.kind, cache_nodes=cache.nodes, k_weight=k_weight, v_weight=v_weight,
        k_bias=name_of(key.bias) if key.bias is not None else None,
        v_bias=name_of(value.bias) if value.bias is not None else None,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=k_shape[-1],
        hidden_size=shape_of(key.x)[-1], scale=attention.scale, softcap=attention.softcap,
        attn_mask=attention.mask,
        out_chain=chain, out_proj=out_proj,
    )


def _is_eager_attention(node: Node) -> bool:
    """A matmul whose left operand comes from a softmax (through casts and dropout): an attention product."""
    weights = node.args[0] if node.args else None
    while is_method(weights, {"to", "type_as"}) or is_function(weights, {F.dropout}):
        weights = weights.args[0]
    return is_function(weights, {F.softmax, torch.softmax}) or is_method(weights, {"softmax"})


def find_sites(gm: GraphModule, name_of: Callable[[Node], Optional[str]] = parameter_name):
    """All attention sites of `gm` in execution order, and the SDPA calls (or eager attention products) that did
    not match (with why)."""
    sites, unmatched = [], []
    for node in gm.graph.nodes:
        if not (is_function(node, SDPA_TARGETS) or is_function(node, MATMUL_TARGETS) and _is_eager_attention(node)):
            continue
        found = _match_one(node, name_of)
        if isinstance(found, str):
            unmatched.append(Unmatched(node.name, found))
        else:
            found.index = len(sites)
            if found.layer is None:
                found.layer = found.index
            sites.append(found)
    return sites, unmatched
