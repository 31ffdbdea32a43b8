"""Rewrite matched attention sites per a rank plan.

Two forms, one set of numbers:
- factored (no cache, or a stock concat cache): k = (x down_k) up_k + b_k, likewise v; the cache keeps
  full keys/values, so memory is not reduced but the model is the plan's low-rank model.
- latent (LatentCache): latents x down are written to the cache, attention rebuilds keys from latents
  (rotate-half RoPE at each slot's stored position; interleaved-RoPE sites have their query and key channels
  permuted into rotate-half order) and applies up_v after the reduction over slots, or absorbs it into
  the output projection (Palu eq. 5: p (C_v B_v) W_o = (p C_v)(B_v W_o)), whichever costs fewer FLOPs.
The factored form fake-quantizes every latent, the current step's included: a stock cache has no slots, so
the sink and window tokens a LatentCache keeps exact are quantized there too (the pessimistic side of the
latent form's numbers).
"""
import math
import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from lrkv_compile.errors import PlanMismatchError, UnrewrittenSiteError
from lrkv_compile.weights import row_index
from .patterns import LINEAR_TARGETS, MATMUL_TARGETS, is_function, is_method, shape_of

PURE_FUNCTIONS = LINEAR_TARGETS | MATMUL_TARGETS | {
    operator.add, operator.mul, operator.neg, operator.getitem, operator.truediv, torch.cat, torch.add, torch.mul,
    torch.neg, torch.tanh, torch.softmax, torch.nn.functional.softmax, torch.nn.functional.dropout, torch.stack,
    torch.flatten, torch.repeat_interleave, torch.gather, torch.split}
PURE_METHODS = {"view", "reshape", "transpose", "contiguous", "unsqueeze", "flatten", "permute", "expand", "size", "to",
                "type_as", "float", "softmax", "tanh", "repeat", "repeat_interleave", "split"}


@dataclass
class SiteReport:
    index: int
    k_weight: str
    cache: str
    status: str                    # "rewritten" | "untouched: <why>"
    rank_k: int = 0
    rank_v: int = 0
    value_path: str = ""


def value_path_cost(num_heads: int, head_dim: int, hidden: int, rank_v: int) -> dict:
    """Multiply-adds per token of the two value paths after the reduction over slots."""
    return {"up after reduction": num_heads * rank_v * head_dim + num_heads * head_dim * hidden,
            "absorbed into output projection": num_heads * rank_v * hidden}


def rotate_half_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A head's channels in the order [0, 2, ..., rotary_dim - 2, 1, 3, ..., rotary_dim - 1, rotary_dim, ...,
    head_dim - 1]: it moves the pair (2i, 2i + 1) that interleaved RoPE turns by angle i to (i, i + rotary_dim / 2),
    which rotate-half RoPE turns by the same angle, so RoPE_interleaved(x)[order] = RoPE_rotate_half(x[order])."""
    return torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, head_dim)))


def choose_value_path(num_heads, head_dim, hidden, rank_v, policy="auto") -> str:
    if policy == "never":
        return "up after reduction"
    if policy == "always":
        return "absorbed into output projection"
    costs = value_path_cost(num_heads, head_dim, hidden, rank_v)
    return min(costs, key=costs.get)


class _Rewriter:
    def __init__(self, gm: GraphModule, example_inputs):
        self.gm, self.graph = gm, gm.graph
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.values = dict(zip(placeholders, example_inputs))
        self.writes = []  # (latent_write node, whether it writes a sliding-window ring after its attention)

    def value_of(self, node: Node) -> torch.Tensor:
        if node.op == "get_attr":
            return getattr(self.gm, node.target)
        return self.values[node]

    def constant(self, name: str, tensor: torch.Tensor, like: Node, dtype=None) -> Node:
        """`tensor` as a buffer of the graph, on `like`'s device, in `dtype` (default: `like`'s)."""
        reference = like.meta.get("example_value")
        tensor = tensor.to(dtype=dtype or reference.dtype, device=reference.device).contiguous()
        self.gm.register_buffer(name, tensor)
        return self.graph.get_attr(name)

    def bias(self, projection, name):
        """The projection's bias node, or for a part of a fused projection a constant of its rows (None: no bias)."""
        if projection.bias is None or projection.rows is None:
            return projection.bias
        value = self.value_of(projection.bias).detach()
        return self.constant(name, value[row_index(projection.rows, value.device)], projection.bias)

    def factored(self, projection, down, up, layout, name):
        """x W[rows]^T + b[rows] -> linear(q(linear(x, down^T)), up^T, b[rows]), q = the layout's
        quantize-dequantize, in place of the projection's output (or heads, `Projection.out_layout`)."""
        with self.graph.inserting_before(projection.out):
            down_w = self.constant(f"{name}_down", down.T, projection.weight)
            up_w = self.constant(f"{name}_up", up.T, projection.weight)
            latent = self.graph.call_function(torch._C._nn.linear, (projection.x, down_w, None))
            if layout.bits != 16:
                latent = self.graph.call_function(torch.ops.lrkv.fake_quantize.default, (latent,),
                                                  {"bits": layout.bits, "group": layout.group, "axis": layout.axis,
                                                   "outliers": layout.outliers})
            rebuilt = self.graph.call_function(torch._C._nn.linear,
                                               (latent, up_w, self.bias(projection, f"{name}_bias")))
            if projection.out_layout == "heads":
                heads, head_dim = shape_of(projection.out)[1], shape_of(projection.out)[3]
                rebuilt = self.graph.call_method("unflatten", (rebuilt, -1, (heads, head_dim)))
                rebuilt = self.graph.call_method("transpose", (rebuilt, 1, 2))
        projection.out.replace_all_uses_with(rebuilt)

    def key_side(self, site, planned, name) -> dict:
        """latent_attention's query and key-side arguments (up_k, bias_k, the key norm's weight). Where RoPE turns
        interleaved channel pairs (GPT-J), each head's channels of the query and of the keys (up_k's columns, the
        bias, the norm weight) are put in `rotate_half_order`, and the op's rotate-half RoPE is the model's:
        q k^T = q[order] k[order]^T, RoPE_interleaved(x)[order] = RoPE_rotate_half(x[order]), and the key norm
        (an RMS over the head's channels) commutes with the permutation."""
        query, up_k, bias_k = site.query, planned.up_k, self.bias(site.key, f"{name}_bias_k")
        norm_weight = site.key.norm.weight if site.key.norm else None
        if site.rope is not None and site.rope.interleaved:
            order = rotate_half_order(site.head_dim, site.rope.rotary_dim)
            head_order = self.constant(f"{name}_head_order", order, site.query, torch.long)
            query = self.graph.call_function(torch.index_select, (query, -1, head_order))
            key_order = (order + site.head_dim * torch.arange(site.num_kv_heads)[:, None]).flatten()
            up_k = up_k[:, key_order]
            if bias_k is not None:
                bias_order = self.constant(f"{name}_key_order", key_order, site.query, torch.long)
                bias_k = self.graph.call_function(torch.index_select, (bias_k, 0, bias_order))
            if norm_weight is not None:
                norm_weight = self.graph.call_function(torch.index_select, (norm_weight, 0, head_order))
        return {"query": query, "up_k": self.constant(f"{name}_up_k", up_k, site.key.weight), "bias_k": bias_k,
                "k_norm_weight": norm_weight}

    def rope(self, source) -> dict:
        """latent_attention's RoPE arguments from a site's RopeSource (None: no RoPE): inv_freq and the scale, or the
        columns of the model's table that hold cos and sin (cos/sin rows stored per token: `latent` passes them)."""
        if source is None or source.rows:
            return {"inv_freq": None, "rope_scale": 1.0}
        arguments = {"inv_freq": source.inv_freq, "rope_scale": source.scale}
        if source.table is not None:
            for part, (start, stop) in (("cos", source.cos_columns), ("sin", source.sin_columns)):
                arguments[f"rope_{part}"] = self.graph.call_function(
                    operator.getitem, (source.table, (slice(None), slice(start, stop))))
        return arguments

    def latent(self, site, planned, value_policy, rope_window=0):
        marker = site.cache_nodes[0]
        cache = marker.normalized_arguments(self.gm, normalize_to_only_use_kwargs=True).kwargs
        layer_idx = cache["layer_idx"]
        if layer_idx != planned.layer:
            raise PlanMismatchError(f"LatentCache layer {layer_idx} runs the site the plan lists as layer {planned.layer}")
        for side, rank, layout in (("k", planned.rank_k, planned.k_layout), ("v", planned.rank_v, planned.v_layout)):
            exact = cache[f"{side}_exact"].meta["example_value"]
            latents = cache[f"latent_{side}"].meta["example_value"]
            scale = cache[f"{side}_scale"].meta["example_value"]
            # a side's rows [batch, slots, width], or the view [batch, slots, blocks, width / blocks] of the same
            # bytes stored by blocks (`quantize.by_blocks`)
            held = (math.prod(latents.shape[2:]), math.prod(scale.shape[2:]) if scale.dim() >= 3 else 0,
                    scale.shape[1] if scale.dim() >= 3 else 0, exact.shape[1] if exact.dim() == 3 else 0)
            needed = (*layout.stored_widths(rank), layout.scale_rows(latents.shape[1]) if layout.bits != 16 else 0,
                      layout.exact_slots)
            if held != needed:
                raise PlanMismatchError(f"layer {layer_idx}: the LatentCache's {side.upper()} buffers have shapes "
                                        f"(latent width, scale width, scale rows, exact tokens) {held}, the plan's "
                                        f"rank {rank} at {layout.bits} bits, scales per {layout.axis} in groups of "
                                        f"{layout.group}, with {layout.sinks} sinks and a window of {layout.window} "
                                        f"needs {needed}; build the LatentCache from the same plan the model is "
                                        "compiled with")
        state = {name: cache[name] for name in ("latent_k", "k_scale", "k_zero", "k_exact", "latent_v", "v_scale",
                                                "v_zero", "v_exact", "positions", "length")}
        rows = site.rope_source is not None and site.rope_source.rows
        if rows:
            held = cache["rope_rows"].meta["example_value"]
            if held.dim() != 4 or held.shape[-1] != site.rope.rotary_dim:
                raise UnrewrittenSiteError(
                    f"layer {layer_idx}: its RoPE frequencies change as the model runs (cos/sin computed outside this "
                    f"graph, or overwritten in it), so a LatentCache stores each token's {site.rope.rotary_dim} cos "
                    f"and sin values, and this one holds rows of shape {tuple(held.shape)}; build the LatentCache "
                    "for this model: lrkv.LatentCache(model, plan, ...)")
        for side, layout in (("k", planned.k_layout), ("v", planned.v_layout)):
            state.update({f"{side}_bits": layout.bits, f"{side}_group": layout.group, f"{side}_sinks": layout.sinks,
                          f"{side}_axis": layout.axis, f"{side}_outliers": layout.outliers})
        name = f"lrkv_site{site.index}"
        weight = site.key.weight
        # a sliding-window layer's latents are a ring shorter than the context: its step attends first, then writes
        ring = cache["latent_k"].meta["example_value"].shape[1] < cache["positions"].meta["example_value"].shape[1]
        with self.graph.inserting_before(marker):
            # both sides' latents in one product, [down_k | down_v], split as views (one launch and one read of the
            # layer's input where there were two; the same weight bytes)
            down = self.constant(f"{name}_down_kv", torch.cat((planned.down_k, planned.down_v), dim=1).T, weight)
            latents = self.graph.call_function(torch._C._nn.linear, (site.key.x, down, None))
            parts = self.graph.call_function(torch.split, (latents, [planned.down_k.shape[1], planned.down_v.shape[1]],
                                                            -1))
            new = {side: self.graph.call_function(operator.getitem, (parts, part))
                   for part, side in enumerate(("new_k", "new_v"))}
            step_rows = {"new_cos": site.rope.cos, "new_sin": site.rope.sin} if rows else {"new_cos": None,
                                                                                         "new_sin": None}
            write = {**state, **new, "new_positions": site.rope_source.positions if site.rope_source else None,
                     "rope_rows": cache["rope_rows"], **step_rows}
            if not ring:
                self.writes.append((self.graph.call_function(torch.ops.lrkv.latent_write.default, kwargs=write),
                                    False))
        path = choose_value_path(site.num_heads, site.head_dim, site.hidden_size, planned.rank_v, value_policy)
        absorb = path.startswith("absorbed") and site.out_proj is not None
        if not absorb:
            path = "up after reduction"
        with self.graph.inserting_before(site.sdpa):
            attention = self.graph.call_function(torch.ops.lrkv.latent_attention.default, kwargs={
                **state, **new, **self.key_side(site, planned, name), **self.rope(site.rope_source),
                "k_norm_offset": site.key.norm.offset if site.key.norm else 0.0,
                "k_norm_eps": site.key.norm.eps if site.key.norm else 0.0, "up_v": None if absorb else self.constant(f"{name}_up_v", planned.up_v, weight),
                "bias_v": None if absorb else self.bias(site.value, f"{name}_bias_v"), "attn_mask": site.attn_mask,
                "softmax_scale": site.scale if site.scale is not None else site.head_dim ** -0.5,
                "softcap": site.softcap, "new_positions": write["new_positions"] if ring else None,
                "num_kv_heads": site.num_kv_heads, "rope_window": rope_window if site.rope_source is not None else 0,
                **({"rope_rows": cache["rope_rows"], **(step_rows if ring else {})} if rows else {})})
        if ring:  # after the cache's length moved past this step: the write starts at length - tokens
            with self.graph.inserting_after(attention):
                tokens = self.graph.call_method("size", (new["new_k"], 1))
            with self.graph.inserting_after(tokens):
                start = self.graph.call_function(operator.sub, (state["length"], tokens))
            with self.graph.inserting_after(start):
                self.writes.append((self.graph.call_function(torch.ops.lrkv.latent_write.default,
                                                             kwargs={**write, "length": start}), True))
        if absorb:
            self.absorb_output(site, planned, attention, name)
        else:
            site.sdpa.replace_all_uses_with(attention)
        return path

    def check_once(self):
        """One device assertion of the context a step (`ops.latent_write`'s device_check), at the graph's first write
        of a full-length cache: it comes before that layer's attention, and every later layer's attention depends on
        it through the hidden states (a ring's write comes after its attention, which nothing later waits for). The
        other writes store nothing past the cache. A graph of rings only asserts at its first."""
        checking = [node for node, ring in self.writes if not ring] or [node for node, _ in self.writes]
        for node, _ in self.writes:
            node.kwargs = {**node.kwargs, "device_check": node is checking[0]}

    def absorb_output(self, site, planned, context, name):
        """o = ctx_flat W_abs^T + b_abs with W_abs[:, h] = (B_v,g(h) W_o,h^T)^T, b_abs = b_o + sum_h b_v,g W_o,h^T."""
        out = site.out_proj
        args = list(out.args) + [None] * (3 - len(out.args))
        w_o = self.value_of(args[1]).detach().double().cpu()           # [hidden, heads * head_dim]
        b_o = self.value_of(args[2]).detach().double().cpu() if args[2] is not None else None
        up_v = planned.up_v.double()                                    # [rank_v, kv_heads * head_dim]
        b_v = self.value_of(site.value.bias).detach().double().cpu() if site.value.bias is not None else None
        if b_v is not None and site.value.rows is not None:
            b_v = b_v[row_index(site.value.rows)]
        heads, kv_heads, d = site.num_heads, site.num_kv_heads, site.head_dim
        group = heads // kv_heads
        absorbed, bias = [], (b_o.clone() if b_o is not None else torch.zeros(w_o.shape[0], dtype=torch.float64))
        for head in range(heads):
            kv = head // group
            w_head = w_o[:, head * d:(head + 1) * d]                     # [hidden, head_dim]
            absorbed.append(w_head @ up_v[:, kv * d:(kv + 1) * d].T)     # [hidden, rank_v]
            if b_v is not None:
                bias = bias + w_head @ b_v[kv * d:(kv + 1) * d]
        with self.graph.inserting_before(out):
            weight = self.constant(f"{name}_absorbed_o", torch.cat(absorbed, dim=1), args[1])
            new_bias = self.constant(f"{name}_absorbed_o_bias", bias, args[1]) if (
                b_o is not None or b_v is not None) else None
            projected = self.graph.call_function(torch._C._nn.linear, (context, weight, new_bias))
        out.replace_all_uses_with(projected)


def _prune(graph):
    """Erase side-effect-free nodes nobody uses (the replaced projections, RoPE on keys, SDPA, the marker)."""
    changed = True
    while changed:
        changed = False
        for node in reversed(graph.nodes):
            if node.users or node.op not in ("call_function", "call_method"):
                continue
            pure = (is_function(node, PURE_FUNCTIONS) or is_method(node, PURE_METHODS)
                    or str(node.target).startswith("lrkv.cache_marker")
                    or node.target in (torch._C._nn.scaled_dot_product_attention,
                                       torch.nn.functional.scaled_dot_product_attention))
            if pure:
                graph.erase_node(node)
                changed = True


def rewrite(gm: GraphModule, sites, plan, example_inputs, value_policy="auto") -> list[SiteReport]:
    """Rewrite every planned site of `gm` in place; sites the plan does not cover are left untouched.
    The caller has checked that the plan fits the sites (`lrkv_compile.fit.check_sites`)."""
    rewriter = _Rewriter(gm, example_inputs)
    reports = []
    for site in sites:
        planned = plan.site_for(site.k_weight)
        if planned is None:
            reports.append(SiteReport(site.index, site.k_weight, site.cache, "untouched: not in the plan"))
            continue
        if site.cache == "latent":
            path = rewriter.latent(site, planned, value_policy, plan.rope_window)
        else:
            rewriter.factored(site.key, planned.down_k, planned.up_k, planned.k_layout, f"lrkv_site{site.index}_k")
            rewriter.factored(site.value, planned.down_v, planned.up_v, planned.v_layout, f"lrkv_site{site.index}_v")
            path = "full values (factored projection)"
        reports.append(SiteReport(site.index, site.k_weight, site.cache, "rewritten", planned.rank_k,
                                  planned.rank_v, path))
    rewriter.check_once()
    _prune(gm.graph)
    rewritten = {r.index for r in reports if r.status == "rewritten"}
    for site in sites:
        if site.index in rewritten and site.cache == "latent" and site.cache_nodes[0] in gm.graph.nodes:
            raise RuntimeError(f"lrkv internal error: site {site.index} still reads full K/V from its LatentCache "
                               "marker after the rewrite; please report this with lrkv.explain(model)")
    gm.graph.lint()
    gm.recompile()
    return reports
