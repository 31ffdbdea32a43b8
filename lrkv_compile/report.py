"""`lrkv.explain`: what the matcher finds in a model, and what a plan would do at each site."""
from rich.console import Console
from rich.table import Table

from lrkv_compile.passes.rewrite import choose_value_path
from .fit import check_parameters, check_sites, trace_sites, warn_left_full
from .rotary import recomputes


def _rope(site) -> str:
    if site.rope is None:
        return "no RoPE"
    rope = "interleaved RoPE" if site.rope.interleaved else "RoPE"
    if site.rope.rotary_dim == site.head_dim:
        return rope
    return f"partial {rope} ({site.rope.rotary_dim} of {site.head_dim})"


def _key_chain(site, recomputed: bool) -> str:
    """The site's key chain; `recomputed`: the model recomputes its RoPE frequencies as it runs, so a LatentCache
    stores each token's cos/sin rows (`rotary.py`)."""
    rope = _rope(site) + (" (frequencies recomputed per call: cos/sin stored per token)"
                          if recomputed and site.rope is not None else "")
    return ", ".join((["q/k norm"] if site.key.norm is not None else []) + [rope])


def explain(model, plan=None, show=True) -> list[dict]:
    """Report every SDPA call of the model's graph: matched sites (by the model's layer index, with the plan's
    ranks, the chosen value path and the cache bytes per token) and unmatched ones with the reason. Returns the
    rows; prints them as a table when `show`. Bytes per token count 2 per 16-bit value (a full fp16 cache's
    layer holds 2 x kv_heads x head_dim values per token), at the plan's context.

    With a plan, the graph is the one generation through a LatentCache gives, and after the table the plan is
    checked against it (`lrkv.check`'s errors and warnings)."""
    if plan is not None:
        check_parameters(plan, model)
    sites, unmatched = trace_sites(model, plan)
    recomputed = any(recomputes(module) for module in model.modules())
    rows = []
    for site in sites:
        full_bytes = 2 * 2 * site.num_kv_heads * site.head_dim
        row = {"layer": site.layer, "status": "matched", "k_weight": site.k_weight, "key chain": _key_chain(site, recomputed),
               "heads": f"{site.num_heads}/{site.num_kv_heads}", "head_dim": site.head_dim,
               "bias": site.k_bias is not None, "bytes/token": f"{full_bytes} (full)"}
        planned = plan.site_for(site.k_weight) if plan is not None else None
        if planned is not None:
            row.update(rank_k=planned.rank_k, rank_v=planned.rank_v, scheme=f"{planned.k_scheme}/{planned.v_scheme}",
                       bits=f"{planned.k_layout.bits}/{planned.v_layout.bits}",
                       value_path=choose_value_path(site.num_heads, site.head_dim, site.hidden_size, planned.rank_v),
                       **{"bytes/token": f"{planned.bytes_per_token(plan.context):.1f} of {full_bytes}"})
        elif plan is not None:
            row["status"] = "matched, not in plan (left untouched)"
        rows.append(row)
    rows += [{"layer": "-", "status": f"unmatched (left untouched): {miss.reason}", "k_weight": miss.node}
             for miss in unmatched]
    if show:
        table = Table(title=f"lrkv: {len(sites)} attention sites matched, {len(unmatched)} unmatched")
        columns = ["layer", "status", "k_weight", "key chain", "heads", "head_dim", "rank_k", "rank_v", "bits",
                   "scheme", "value_path", "bytes/token"]
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*(str(row.get(column, "")) for column in columns))
        console = Console()
        if not console.is_terminal:  # a log or a pipe: do not cut the table to 80 columns
            console.width = 200
        console.print(table)
    if plan is not None:
        warn_left_full(check_sites(plan, sites, unmatched))
    return rows
