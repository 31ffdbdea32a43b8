"""`lrkv.transfer`: carry a plan made on one model over to another (a fine-tune, or another architecture).

The expensive part of calibration is choosing each layer's ranks and bits under a byte budget. A plan's choices
carry over as shares: each side (K, V) of each layer keeps a fraction of its 16-bit bytes, with its layout
(bits, group, scale axis, sinks, window, rotation). The target's layers take the shares of the source layers at
the same relative depth, the ranks are set to those shares of the target's own dimensions, trimmed until the
latents take no larger a share of the target's 16-bit cache than the source plan's do (its budget without the
4 bytes of position per token, which weigh more in a smaller model), and the factors are re-estimated from the
target's text (one pass of activation statistics and one whitened SVD per side, as calibration does before its
search).
"""
import math
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lrkv_compile.passes.factorize import blocks_for
from .calibrate import DEFAULT_GROUP_SIZE, as_batches, collect_stats, side_spectra, site_plans
from .errors import PlanError
from .plan import POSITION_BYTES, RankPlan


@dataclass(frozen=True)
class Mapping:
    """One target side's carry-over: the source layer it follows, the source's share of the 16-bit bytes, and
    what the target got (rank, layout, share, and what had to change)."""
    layer: int
    side: str
    source_layer: int
    source_share: float
    rank: int
    full_dim: int
    layout: object
    share: float
    note: str = ""


def _source_layer(index: int, count: int, source_count: int) -> int:
    """The source layer at the relative depth of target layer `index` of `count` (nearest)."""
    return 0 if count == 1 else round(index * (source_count - 1) / (count - 1))


def _share(layout, rank: int, full_dim: int, context: int) -> float:
    return layout.bytes_per_token(rank, context) / (2 * full_dim)


def _ranks(blocks: int, cap: int, outliers: int) -> list[int]:
    """Candidate ranks of a side: multiples of 8 and of its blocks up to `cap` (and `cap`), above its outlier
    channels."""
    step = math.lcm(blocks, 8)
    ranks = [rank for rank in range(step, cap + 1, step) if rank > outliers]
    return ranks + [cap] if cap % blocks == 0 and cap > outliers and cap not in ranks else ranks


def _layout_at(layout, source_rank: int, rank: int):
    """The source side's layout at the target's `rank`: a per-token scale group spanning all quantized channels
    keeps spanning them; another keeps its size where it divides the target's quantized channels, else spans them."""
    if layout.bits == 16 or layout.axis == "channel":
        return layout
    quantized = rank - layout.outliers
    spans = layout.group == source_rank - layout.outliers
    return replace(layout, group=quantized if spans or quantized % layout.group else layout.group)


def _scheme(scheme: str, kv_heads: int, group_size: int):
    """The source side's scheme where the target's KV heads allow it, else joint; (scheme, blocks, note)."""
    try:
        return scheme, blocks_for(scheme, kv_heads, group_size), ""
    except ValueError:
        return "joint", 1, f"joint (its {kv_heads} KV heads do not take {scheme})"


def transfer(plan, model, batches, progress: bool = True, show: bool = True) -> RankPlan:
    """A plan for `model` made from `plan` (a RankPlan, or the path of a saved one) of another model: each target
    layer takes the byte shares and layouts of the source layer at its relative depth, within the source plan's
    budget, with factors re-estimated from `batches` (token ids of the target's text, as `lrkv.calibrate` takes
    them). Prints the mapping when `show`; `transfer_with_mapping` also returns it."""
    return transfer_with_mapping(plan, model, batches, progress, show)[0]


def transfer_with_mapping(plan, model, batches, progress: bool = True, show: bool = True):
    """`transfer`, returning (plan, [Mapping per target layer and side])."""
    if isinstance(plan, (str, Path)):
        plan = RankPlan.load(plan)
    if not isinstance(plan, RankPlan):
        raise PlanError(f"transfer needs a RankPlan or the path of a saved plan, got {type(plan).__name__}")
    stats = collect_stats(model, as_batches(batches), progress)
    sites, context = stats.sites, plan.context
    schemes, blocks, options, choices, origins = {}, {}, {}, {}, {}
    for position, site in enumerate(sites):
        source = plan.sites[_source_layer(position, len(sites), len(plan.sites))]
        full_dim = site.num_kv_heads * site.head_dim
        for side in ("k", "v"):
            source_layout, source_rank = getattr(source, f"{side}_layout"), getattr(source, f"rank_{side}")
            source_share = _share(source_layout, source_rank, source.full_dim, context)
            scheme, side_blocks, note = _scheme(getattr(source, f"{side}_scheme"), site.num_kv_heads,
                                                DEFAULT_GROUP_SIZE)
            layout = source_layout
            if layout.outliers and side_blocks != 1:
                layout, note = replace(layout, outliers=0), ", ".join(filter(None, (note, "no outlier channels")))
            # (share, rank, layout) from the smallest rank up
            found = [(_share(at, rank, full_dim, context), rank, at) for rank in
                     _ranks(side_blocks, min(site.hidden_size, full_dim), layout.outliers)
                     for at in [_layout_at(layout, source_rank, rank)]]
            if not found:
                raise PlanError(f"layer {site.layer} {side.upper()}: no rank of its {full_dim} channels fits the "
                                f"source layout {source_layout}; calibrate this model directly (lrkv.calibrate)")
            schemes[site.index, side], blocks[site.index, side] = scheme, side_blocks
            options[site.index, side] = found
            choices[site.index, side] = min(range(len(found)), key=lambda i: abs(found[i][0] - source_share))
            origins[site.index, side] = (source.layer, source_share, note)
    _trim_to_budget(sites, options, choices, origins, latent_share(plan))
    choices = {key: options[key][choice][1:] for key, choice in choices.items()}
    _, spectra = side_spectra(model, sites, stats, blocks, progress)
    result = RankPlan(sites=site_plans(model, sites, schemes, blocks, spectra, choices),
                      source=f"transferred from a {len(plan.sites)}-layer plan ({plan.source})",
                      calibration_tokens=stats.tokens, context=context)
    mapping = []
    for site in sites:
        full_dim = site.num_kv_heads * site.head_dim
        for side in ("k", "v"):
            (rank, layout), (source_layer, source_share, note) = choices[site.index, side], origins[site.index, side]
            mapping.append(Mapping(site.layer, side, source_layer, source_share, rank, full_dim, layout,
                                   _share(layout, rank, full_dim, context), note))
    if show:
        _print(mapping, plan, result)
    return result, mapping


def latent_share(plan: RankPlan) -> float:
    """The latents' share of a 16-bit cache's bytes under `plan`: its budget without the positions (4 bytes per
    token, whatever the model's size)."""
    return plan.budget - POSITION_BYTES / sum(2 * 2 * site.full_dim for site in plan.sites)


def _trim_to_budget(sites, options, choices, origins, share: float) -> None:
    """Step ranks down, each time the side furthest above its source share, until the latents take at most
    `share` of the model's 16-bit cache bytes."""
    full = {(site.index, side): site.num_kv_heads * site.head_dim for site in sites for side in ("k", "v")}

    def total():
        return sum(options[key][choice][0] * full[key] for key, choice in choices.items()) / sum(full.values())
    while total() > share * (1 + 1e-9):
        lowerable = [key for key, choice in choices.items() if choice > 0]
        if not lowerable:
            raise PlanError(f"the source plan's latents take {share:.3f} of a 16-bit cache's bytes, and this model's "
                            f"take {total():.3f} at their smallest ranks in the source's layouts; calibrate it "
                            "directly (lrkv.calibrate(model, batches, budget=...))")
        key = max(lowerable, key=lambda key: options[key][choices[key]][0] / origins[key][1])
        choices[key] -= 1


def _layout_text(layout) -> str:
    if layout.bits == 16:
        return "16-bit"
    return f"{layout.bits}-bit/{layout.group} {layout.axis}"


def _print(mapping, source, result) -> None:
    table = Table(title=f"lrkv transfer: {len(source.sites)}-layer plan (budget {source.budget:.3f}) -> "
                        f"{len(result.sites)} layers (budget {result.budget:.3f})")
    for column in ("layer", "side", "from layer", "source share", "rank", "layout", "share", "note"):
        table.add_column(column)
    for row in mapping:
        table.add_row(str(row.layer), row.side.upper(), str(row.source_layer), f"{row.source_share:.3f}",
                      f"{row.rank}/{row.full_dim}", _layout_text(row.layout), f"{row.share:.3f}", row.note)
    console = Console()
    if not console.is_terminal:
        console.width = 160
    console.print(table)

