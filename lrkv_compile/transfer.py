"""`lrkv.transfer`: carry a plan made on one model over to another (a fine-tune, or another architecture).

Calibration scores every (rank, bits, group) candidate of every site and searches the whole model's allocation
under the budget. A transfer keeps the source plan's budget (its latents' share of a 16-bit cache at its context)
and layouts' rotation, sinks and window, takes each layer's byte share from it, and measures on the target only
how to spend each layer's bytes:

- Each target layer gets a share of its 16-bit bytes: the source layer's at the same relative depth when the
  target has as many layers as the source (a fine-tune, or a sibling of the same depth), else the source's mean
  share; scaled so that the latents take the source's share of the target's cache. Relative depth does not carry
  a layer's importance from one architecture to another: on Gemma 3 270M (perplexity on held-out rows of the
  calibration text, budget 0.2), the layouts measured within the shares of SmolLM2's layers at the same depth
  gave 28.3, within equal shares 26.8, and within equal shares split between K and V as SmolLM2 splits them 29.4.
- Within its layer's bytes, K and V get the (rank, layout) pair of least estimated loss among calibration's
  candidates (`lrkv_compile.allocate`: factored, rotated and quantized as the plan will be, scored by their
  Fisher-weighted output error) and the source side's own layout at the rank of its share; the loss gradients
  for that come from the first MEASURED_ROWS rows of the text only (from every row of statistics handed in with
  `stats=`).
- The factors are re-estimated from all of the target's text (one pass of activation statistics, one whitened
  SVD per side).
"""
import math
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from lrkv_compile.passes.factorize import blocks_for
from .allocate import OUTLIER_CHANNELS, candidate_ranks, score, search, with_exact
from .calibrate import (DEFAULT_GROUP_SIZE, DEFAULT_SINKS, DEFAULT_WINDOW, _factor, as_batches, check_stats,
                        collect_stats, side_spectra, site_plans)
from .errors import PlanError
from .plan import POSITION_BYTES, RankPlan

# Rows of the target's text whose loss gradients weigh the candidates (on Gemma 3 270M a row of 512 tokens with
# its backward pass takes about three times its forward pass). There, Fisher matrices from 2 rows chose the same
# layouts as from 4 (held-out perplexity 27.0; 26.8 with the gradients of all 8 rows, as calibration takes them).
MEASURED_ROWS = 2


@dataclass(frozen=True)
class Mapping:
    """One target side's carry-over: the source layer it follows, the source side's share of its 16-bit bytes,
    the share of its layer's 16-bit bytes the layer got, and what the side got (rank, layout, share)."""
    layer: int
    side: str
    source_layer: int
    source_share: float
    layer_share: float
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
    """Ranks of a side for the source's layout: multiples of 8 and of its blocks up to `cap` (and `cap`), above
    its outlier channels."""
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


def _carried(layout, source_rank: int, source_share: float, blocks: int, cap: int, full_dim: int, context: int):
    """(rank, layout): the source side's layout at the target rank whose share is nearest the source's, or None
    where no rank of the target takes that layout."""
    found = [(rank, _layout_at(layout, source_rank, rank)) for rank in _ranks(blocks, cap, layout.outliers)]
    if not found:
        return None
    return min(found, key=lambda pair: abs(_share(pair[1], pair[0], full_dim, context) - source_share))


def transfer(plan, model, batches=None, progress: bool = True, show: bool = True, stats=None) -> RankPlan:
    """A plan for `model` made from `plan` (a RankPlan, or the path of a saved one) of another model, within the
    source plan's budget: each target layer gets a byte share (the source's at the same relative depth for a
    target of the source's depth, else an equal one), and within it the ranks and layouts of its K and V that
    measure best on `batches` (token ids of the target's text, as `lrkv.calibrate` takes them), with factors
    re-estimated from them. Instead of `batches`, `stats`: `collect_stats(model, batches, fisher=True)`, one pass
    over the text shared with `lrkv.calibrate(model, stats=stats, ...)` (its gradients then come from every row).
    Prints the mapping when `show`; `transfer_with_mapping` also returns it."""
    return transfer_with_mapping(plan, model, batches, progress, show, stats)[0]


def transfer_with_mapping(plan, model, batches=None, progress: bool = True, show: bool = True, stats=None):
    """`transfer`, returning (plan, [Mapping per target layer and side])."""
    if isinstance(plan, (str, Path)):
        plan = RankPlan.load(plan)
    if not isinstance(plan, RankPlan):
        raise PlanError(f"transfer needs a RankPlan or the path of a saved plan, got {type(plan).__name__}")
    if (batches is None) == (stats is None):
        raise PlanError("transfer measures on the target's text: pass batches (token ids) or stats "
                        "(collect_stats(model, batches, fisher=True)), one of the two")
    if stats is not None:
        check_stats(stats, "transfer, which weighs each layout by the loss gradients,")
        return _transfer(plan, model, stats, stats, progress, show)
    rows = [row[None] for batch in as_batches(batches) for row in batch]
    measured = collect_stats(model, rows[:MEASURED_ROWS], progress, fisher=True)
    stats = measured
    if rows[MEASURED_ROWS:]:  # the activation statistics of the other rows, added to the measured rows' ones
        stats = collect_stats(model, rows[MEASURED_ROWS:], progress)
        stats.grams[:] = [gram + measured_gram for gram, measured_gram in zip(stats.grams, measured.grams)]
        stats.tokens += measured.tokens
    return _transfer(plan, model, measured, stats, progress, show)


def _transfer(plan, model, measured, stats, progress, show):
    """`transfer_with_mapping` with the statistics gathered: `measured` (with gradients) scores the candidates,
    `stats` (every row's activations) gives the factors."""
    sites, context = stats.sites, plan.context
    follow_depth = len(sites) == len(plan.sites)
    sources = [plan.sites[_source_layer(position, len(sites), len(plan.sites))] for position in range(len(sites))]
    layer_shares = [source.bytes_per_token(context) / (4 * source.full_dim) if follow_depth else latent_share(plan)
                    for source in sources]
    full_dims = [site.num_kv_heads * site.head_dim for site in sites]
    # scaled so that the layers' bytes add up to the source's latent share of this model's 16-bit cache
    scale = latent_share(plan) * sum(full_dims) / sum(share * dim for share, dim in zip(layer_shares, full_dims))
    schemes, blocks, origins, carried_layouts, carried = {}, {}, {}, {}, {}
    for site, source in zip(sites, sources):
        full_dim = site.num_kv_heads * site.head_dim
        for side in ("k", "v"):
            source_layout, source_rank = getattr(source, f"{side}_layout"), getattr(source, f"rank_{side}")
            source_share = _share(source_layout, source_rank, source.full_dim, context)
            scheme, side_blocks, note = _scheme(getattr(source, f"{side}_scheme"), site.num_kv_heads,
                                                DEFAULT_GROUP_SIZE)
            if source_layout.outliers and side_blocks != 1:
                source_layout = replace(source_layout, outliers=0)
                note = ", ".join(filter(None, (note, "no outlier channels")))
            schemes[site.index, side], blocks[site.index, side] = scheme, side_blocks
            origins[site.index, side] = (source.layer, source_share, source_layout, note)
            carried_layouts[site.index, side] = _carried(source_layout, source_rank, source_share, side_blocks,
                                                         min(site.hidden_size, full_dim), full_dim, context)
    weights, spectra = side_spectra(model, sites, stats, blocks, progress)
    choices = {}
    for site, layer_share in zip(tqdm(sites, desc="lrkv transfer: measure layouts", disable=not progress,
                                      unit="layer"), layer_shares):
        options = {}
        for side in ("k", "v"):
            key = (site.index, side)
            options[key], carried[key] = _candidates(site, side, blocks[key], origins[key][2], carried_layouts[key],
                                                     weights[key], spectra[key], measured, context)
        choices.update(_best_in_layer(site, options, layer_share * scale * 4 * full_dims[site.index]))
    result = RankPlan(sites=site_plans(model, sites, schemes, blocks, spectra,
                                       {key: (c.rank, c.layout) for key, c in choices.items()}),
                      source=f"transferred from a {len(plan.sites)}-layer plan ({plan.source})",
                      calibration_tokens=stats.tokens, context=context,
                      rope_window=plan.rope_window)
    mapping = []
    for site, layer_share in zip(sites, layer_shares):
        for side in ("k", "v"):
            key = (site.index, side)
            chosen, (source_layer, source_share, _, note) = choices[key], origins[key]
            if chosen is carried[key]:
                note = ", ".join(filter(None, ("the source's layout", note)))
            mapping.append(Mapping(site.layer, side, source_layer, source_share, layer_share * scale, chosen.rank,
                                   full_dims[site.index], chosen.layout,
                                   _share(chosen.layout, chosen.rank, full_dims[site.index], context), note))
    if show:
        _print(mapping, plan, result, "the source's by depth" if follow_depth else "equal (another depth)")
    return result, mapping


def _candidates(site, side, side_blocks, source_layout, carried, weight, factors, measured, context):
    """(candidates, the carried one or None) of one side, scored on the measured rows: calibration's (with the
    source layout's rotation, sinks and window where it is quantized), and the source's own layout at its carried
    (rank, layout), if any."""
    quantized = source_layout.bits != 16
    rotation = source_layout.rotation if quantized else "hadamard"
    sinks, window = (source_layout.sinks, source_layout.window) if quantized else (DEFAULT_SINKS, DEFAULT_WINDOW)
    samples, full_dim = measured.samples[site.index], site.num_kv_heads * site.head_dim
    scored = score(lambda rank, layout: _factor(factors, side_blocks, rank, layout, site.index), samples,
                   samples @ weight.T, (measured.fisher[site.index, side] / measured.tokens).float(),
                   candidate_ranks(full_dim, site.hidden_size, side_blocks), rotation,
                   (0, *OUTLIER_CHANNELS) if side_blocks == 1 else (0,), extra=[carried] if carried else ())
    if not carried:
        return [with_exact(candidate, sinks, window, context) for candidate in scored], None
    found = [with_exact(candidate, sinks, window, context) for candidate in scored[:-1]]
    own = replace(scored[-1], bytes=scored[-1].layout.bytes_per_token(scored[-1].rank, context))
    return found + [own], own


def _best_in_layer(site, options, layer_bytes: float) -> dict:
    """{(site, side): Candidate}: the K and V candidates of least summed cost within `layer_bytes` per token."""
    sides = {(site.index, side): options[site.index, side] for side in ("k", "v")}
    smallest = sum(min(candidate.bytes for candidate in found) for found in sides.values())
    if smallest > layer_bytes:
        raise PlanError(f"layer {site.layer} gets {layer_bytes:.1f} bytes per token of the source plan's budget and "
                        f"takes at least {smallest:.1f} (its K and V at their lowest ranks and 2 bits); calibrate "
                        "this model directly (lrkv.calibrate(model, batches, budget=...))")
    return search(sides, layer_bytes)


def latent_share(plan: RankPlan) -> float:
    """The latents' share of a 16-bit cache's bytes under `plan`: its budget without the positions (4 bytes per
    token, whatever the model's size)."""
    return plan.budget - POSITION_BYTES / sum(2 * 2 * site.full_dim for site in plan.sites)


def _layout_text(layout) -> str:
    if layout.bits == 16:
        return "16-bit"
    outliers = f" +{layout.outliers} fp16" if layout.outliers else ""
    return f"{layout.bits}-bit/{layout.group} {layout.axis}{outliers}"


def _print(mapping, source, result, shares: str) -> None:
    table = Table(title=f"lrkv transfer: {len(source.sites)}-layer plan (budget {source.budget:.3f}) -> "
                        f"{len(result.sites)} layers (budget {result.budget:.3f}); layer shares {shares}")
    for column in ("layer", "side", "from layer", "source share", "layer share", "rank", "layout", "share", "note"):
        table.add_column(column)
    for row in mapping:
        table.add_row(str(row.layer), row.side.upper(), str(row.source_layer), f"{row.source_share:.3f}",
                      f"{row.layer_share:.3f}", f"{row.rank}/{row.full_dim}", _layout_text(row.layout),
                      f"{row.share:.3f}", row.note)
    console = Console()
    if not console.is_terminal:
        console.width = 160
    console.print(table)
