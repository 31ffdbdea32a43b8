"""Find every attention site of a Dynamo FX graph by structure, one record per site.

A site is: K and V head projections (linear -> view -> transpose, bias optional), optional
rotate-half RoPE on keys (and queries), a cache (none, a stock concat cache, or the lrkv latent
cache marker), SDPA with or without GQA, and the output projection behind it. Anything else is
left alone and reported with the reason.
"""
import operator
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.fx import GraphModule, Node

from lrkv_compile.signature import SiteSignature
from .patterns import (SDPA_TARGETS, RopeSource, follow_layout_chain, is_function, match_head_projection, match_rope,
                       match_rope_source, shape_of, unwrap_repeat_kv, unwrap_slot_crop)

CACHE_MARKER = "lrkv.cache_marker"


@dataclass
class AttentionSite:
    index: int                      # order of execution among matched sites (= the model's layer index)
    sdpa: Node
    query: Node
    key: object                     # patterns.Projection
    value: object
    rope: Optional[object]           # RoPE on the new keys, None for models without it
    rope_source: Optional[RopeSource]  # the positions and frequencies its cos/sin come from (latent sites: always)
    cache: str                      # "none" | "concat" | "latent"
    cache_nodes: tuple = ()         # concat: (cat_k, cat_v); latent: (marker, getitem_k, getitem_v)
    k_weight: str = ""
    v_weight: str = ""
    k_bias: Optional[str] = None
    v_bias: Optional[str] = None
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    scale: Optional[float] = None
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


_PLACEHOLDER_PART = re.compile(r"_(modules|parameters|buffers)_")


def parameter_name(node: Node) -> Optional[str]:
    """Dynamo names a parameter placeholder after its access path, e.g.
    l_self_modules_model_modules_layers_modules_0_modules_self_attn_modules_k_proj_parameters_weight_
    -> model.layers.0.self_attn.k_proj.weight."""
    name = node.name
    if node.op != "placeholder" or not name.startswith("l_self_") or not name.endswith("_"):
        return None
    parts = _PLACEHOLDER_PART.split("_" + name[len("l_self_"):-1])
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
    return "none", node, ()


def _match_one(sdpa: Node, name_of: Callable[[Node], Optional[str]]):
    args = list(sdpa.args) + [None] * 6
    query, key_in, value_in = (sdpa.kwargs.get(k, args[i]) for i, k in enumerate(("query", "key", "value")))
    if sdpa.kwargs.get("dropout_p", args[4] or 0.0) != 0.0:
        return "attention dropout is on (a model in training mode); call model.eval()"
    cropped = unwrap_slot_crop(key_in) is not key_in
    if cropped != (unwrap_slot_crop(value_in) is not value_in):
        return "keys and values are cropped to different slots"
    key_in, value_in = unwrap_slot_crop(key_in), unwrap_slot_crop(value_in)
    repeated = unwrap_repeat_kv(key_in) is not key_in
    k_cache, k_new, k_nodes = _split_cache(unwrap_repeat_kv(key_in))
    v_cache, v_new, v_nodes = _split_cache(unwrap_repeat_kv(value_in))
    if k_cache != v_cache:
        return f"keys and values use different caches ({k_cache} / {v_cache})"
    if k_cache == "latent" and sdpa.kwargs.get("is_causal", args[5]) and not cropped:
        # SDPA's is_causal aligns the causal mask top-left; the latent attention aligns it to the newest slot.
        # The two agree only when keys are cropped to the queries (a prefill into an empty cache).
        return "is_causal=True over a cache longer than the queries (top-left aligned causal mask)"
    if k_cache == "latent" and k_nodes[0] is not v_nodes[0]:
        return "keys and values come from different LatentCache updates"
    rope = match_rope(k_new)
    key = match_head_projection(rope.x if rope else k_new)
    if key is None:
        return ("keys are neither rotate-half RoPE over a head projection nor a plain head projection "
                "(interleaved or partial RoPE, or an unknown layout)")
    value = match_head_projection(v_new)
    if value is None:
        return "values are not a head projection (linear -> view -> transpose)"
    if key.x is not value.x:
        return "K and V projections read different inputs"
    q_shape, k_shape, v_shape = shape_of(query), shape_of(key.heads_out), shape_of(value.heads_out)
    if not (q_shape and k_shape and v_shape) or len(q_shape) != 4:
        return "missing shape metadata on q/k/v"
    if k_shape[-1] != v_shape[-1] or k_shape[1] != v_shape[1]:
        return "K and V have different head layouts"
    rope_source = None
    if rope is not None:
        cos_shape = shape_of(rope.cos)
        if cos_shape is None or len(cos_shape) != 4 or cos_shape[1] != 1 or cos_shape[-1] != k_shape[-1]:
            return "RoPE tables are not [batch, 1, tokens, head_dim]"
        rope_source = match_rope_source(rope.cos, rope.sin)
        if isinstance(rope_source, str):
            if k_cache == "latent":  # a LatentCache stores positions, not RoPE rows: it needs their source
                return f"{rope_source}, so a LatentCache cannot rebuild RoPE from stored positions"
            rope_source = None  # a stock cache (or none) keeps full keys: the factored rewrite needs no source
    num_heads, num_kv_heads = q_shape[1], k_shape[1]
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    if num_heads != num_kv_heads and not (repeated or sdpa.kwargs.get("enable_gqa", False)):
        return "query and KV head counts differ but SDPA neither repeats K/V nor sets enable_gqa"
    k_weight, v_weight = name_of(key.weight), name_of(value.weight)
    if not k_weight or not v_weight:
        return "cannot name the K/V weight parameters"
    chain, out_proj = follow_layout_chain(sdpa)
    mask = sdpa.kwargs.get("attn_mask", args[3])
    cache_nodes = k_nodes + v_nodes if k_cache == "concat" else k_nodes
    return AttentionSite(
        index=-1, sdpa=sdpa, query=query, key=key, value=value, rope=rope, rope_source=rope_source, cache=k_cache,
        cache_nodes=cache_nodes,
        k_weight=k_weight, v_weight=v_weight,
        k_bias=name_of(key.bias) if key.bias is not None else None,
        v_bias=name_of(value.bias) if value.bias is not None else None,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=k_shape[-1],
        hidden_size=shape_of(key.x)[-1], scale=sdpa.kwargs.get("scale"), attn_mask=mask,
        out_chain=chain, out_proj=out_proj,
    )


def find_sites(gm: GraphModule, name_of: Callable[[Node], Optional[str]] = parameter_name):
    """All attention sites of `gm` in execution order, and the SDPA calls that did not match (with why)."""
    sites, unmatched = [], []
    for node in gm.graph.nodes:
        if not is_function(node, SDPA_TARGETS):
            continue
        found = _match_one(node, name_of)
        if isinstance(found, str):
            unmatched.append(Unmatched(node.name, found))
        else:
            found.index = len(sites)
            sites.append(found)
    return sites, unmatched
