"""Build rank plans: discover sites, gather activation statistics, factorize per scheme and keep.

Every input is validated before the model is traced or run; the model is traced once per row length
(one trace for the usual equal-length rows), and that trace both names the sites and records their inputs.
"""
import math
import numbers
import warnings
from functools import partial
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from lrkv_compile.passes.factorize import ROTATIONS, SCHEMES, blocks_for, rotate, spectrum, truncate, whitening_factor
from lrkv_compile.passes.sites import find_sites
from .allocate import (CANDIDATE_BITS, CANDIDATE_GROUPS, METHODS, OUTLIER_CHANNELS, candidate_ranks, score, search,
                       with_exact)
from .errors import LrkvWarning, PlanError
from . import stats_cache
from .learned import learn_ranks
from .plan import (DEFAULT_CONTEXT, POSITION_BYTES, Layout, RankPlan, SitePlan, check_context, check_keep,
                   check_rope_window, rank_for, weight_fingerprint)
from .trace import capture
from .weights import ProjectionWeights

HYBRID = {"hybrid": ("head", "joint")}  # STAR-KV: head-wise keys, joint values
DEFAULT_GROUP_SIZE = 4  # Palu's default group of heads for G-LRD
# Quantized sides keep the first tokens exact (StreamingLLM's four attention sinks). A recent window (KIVI keeps
# 32 to 128 tokens) is off by default: on SmolLM2 at budget 0.2 counted at 512 tokens (continuation protocol,
# 10 passkeys), 4 sinks gave 1.014x the full cache's perplexity and 9 keys, no sinks 1.023x and 9, 4 sinks with
# a window of 16 1.041x and 8, of 32 1.066x and 9: at that length the window's bytes cost more than it returns.
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 0


def as_batches(batches) -> list[torch.Tensor]:
    """Accept a [batch, tokens] tensor, a [tokens] tensor, or an iterable of either (read once); return a
    list of 2-D tensors."""
    if isinstance(batches, torch.Tensor):
        batches = [batches]
    if isinstance(batches, Mapping):
        raise PlanError(f"calibration batches are a {type(batches).__name__} (a tokenizer's output?); pass its "
                        "['input_ids'] tensor")
    try:
        batches = list(batches)
    except TypeError:
        raise PlanError(f"calibration batches must be token-id tensors or an iterable of them, "
                        f"got {type(batches).__name__}") from None
    out = []
    for position, batch in enumerate(batches):
        if not isinstance(batch, torch.Tensor) or batch.dtype not in (torch.int32, torch.int64):
            described = f"a {batch.dtype} tensor" if isinstance(batch, torch.Tensor) else type(batch).__name__
            raise PlanError(f"calibration batch {position} is {described}; it must be an integer tensor of token ids")
        if batch.dim() == 1:
            batch = batch[None]
        if batch.dim() != 2 or batch.shape[1] < 2 or batch.shape[0] < 1:
            raise PlanError(f"calibration batch {position} has shape {tuple(batch.shape)}; expected [batch, tokens] "
                            "with at least 2 tokens")
        out.append(batch)
    if not out:
        raise PlanError("no calibration batches given (an empty list, or an iterator that was already used up)")
    return out


def discover(model, input_ids):
    """Trace `model` once on `input_ids`; (graph, example inputs, input_ids index, sites, unmatched)."""
    gm, example_inputs, ids_index, name_of = capture(model, input_ids)
    sites, unmatched = find_sites(gm, name_of)
    if not sites:
        reasons = "; ".join(f"{u.node}: {u.reason}" for u in unmatched) or "the graph has no SDPA call"
        raise PlanError(f"no attention site of this model matched ({reasons}); lrkv cannot plan it")
    return gm, example_inputs, ids_index, sites, unmatched


@dataclass
class CalibrationStats:
    """What one pass over the calibration text gives: the sites (from the trace), each site's K/V input
    Gram x^T x (float64, summed over `tokens` tokens), and, when collected with `fisher=True`, the Fisher
    matrix g^T g of the loss gradient at each site's K and V outputs ({(site, "k"|"v"): summed}) and
    `samples`: up to SAMPLES K/V inputs per site, spread over the text, to measure candidate errors on."""
    sites: list
    unmatched: list
    grams: list
    tokens: int
    fisher: dict = None
    samples: list = None
    scored: dict = field(default_factory=dict)  # allocation candidates, kept for further budgets


SAMPLES = 512


def check_stats(stats, fisher_for: str | None = None) -> None:
    """PlanError unless `stats` is what `collect_stats` returns, with the Fisher matrices (`fisher=True`) when
    `fisher_for` (what needs them) is given."""
    if not isinstance(stats, CalibrationStats):
        raise PlanError(f"stats must be the CalibrationStats that collect_stats returns, got {type(stats).__name__}")
    if fisher_for and stats.fisher is None:
        raise PlanError(f"{fisher_for} needs stats collected with collect_stats(..., fisher=True); these were "
                        "collected without fisher=True")


class _Recorder:
    """Called from inside the traced graph: accumulates each site's input Gram (float64), keeps a sample
    of its inputs, and puts a zero leaf on its K/V outputs whose gradient is the loss gradient there."""

    def __init__(self, count, stride, fisher):
        self.grams = [None] * count
        self.samples = [[] for _ in range(count)]
        self.stride, self.fisher = stride, fisher
        self.leaves = {}

    def record(self, site_index, x):
        flat = x.detach().reshape(-1, x.shape[-1]).double().cpu()
        gram = flat.T @ flat
        self.grams[site_index] = gram if self.grams[site_index] is None else self.grams[site_index] + gram
        if self.fisher:
            self.samples[site_index].append(flat[::self.stride].float())
        return x

    def output(self, site_index, side, y, heads=False):
        """y + a zero leaf of y's shape, or for heads [batch, heads, tokens, head_dim] (a fused projection split
        after its heads view) of the flat [batch, tokens, heads * head_dim], as the projection's outputs."""
        flat = y.transpose(1, 2).flatten(-2) if heads else y
        leaf = torch.zeros_like(flat, requires_grad=True)
        self.leaves[site_index, side] = leaf
        return y + (leaf.unflatten(-1, (y.shape[1], y.shape[3])).transpose(1, 2) if heads else leaf)


def _instrument(gm, sites, recorder):
    for site in sites:
        with gm.graph.inserting_after(site.key.x):
            recorded = gm.graph.call_function(recorder.record, (site.index, site.key.x))
        site.key.x.replace_all_uses_with(recorded, delete_user_cb=lambda user: user is not recorded)
        if recorder.fisher:
            for side, projection in (("k", site.key), ("v", site.value)):
                with gm.graph.inserting_after(projection.out):
                    marked = gm.graph.call_function(recorder.output, (site.index, side, projection.out,
                                                                      projection.out_layout == "heads"))
                projection.out.replace_all_uses_with(marked, delete_user_cb=lambda user: user is not marked)
    gm.recompile()


def _logits(outputs, row, vocab_size):
    found = [t for t in outputs if isinstance(t, torch.Tensor) and tuple(t.shape) == (1, row.shape[1], vocab_size)]
    if len(found) != 1:
        raise RuntimeError(f"lrkv internal error: {len(found)} graph outputs have the shape of the logits")
    return found[0]


def collect_stats(model, batches, progress=True, check_sites=None, fisher=False, cache=True) -> CalibrationStats:
    """Statistics of every site's K/V projections over the calibration rows, one row per step.

    fisher: also run the loss backward on each row (next-token cross-entropy), for the Fisher matrices
    and input samples that budget allocation (`lrkv_compile.allocate`) scores candidates with.
    check_sites(sites), if given, runs after the first trace and before any row is run.
    cache: read them from, or keep them in, the statistics cache on disk (`lrkv_compile.stats_cache`): the same
    model and text give the same statistics, so a second plan from them needs only the trace.
    """
    rows = [row[None] for batch in as_batches(batches) for row in batch]
    device = next(model.parameters()).device
    traces, stats, recorder = {}, None, None
    total = sum(row.shape[1] for row in rows)
    stride = max(1, total // SAMPLES)
    kept = stats_cache.entry(model, rows, fisher, SAMPLES) if cache else None
    vocab_size = model.get_output_embeddings().weight.shape[0]
    bar = tqdm(total=total, desc="lrkv calibrate: activations" + (" and gradients" if fisher else ""),
               disable=not progress, unit="tok")
    with bar:
        for row in rows:
            row = row.to(device)
            length = row.shape[1]
            if length not in traces:
                gm, example_inputs, ids_index, sites, unmatched = discover(model, row)
                if stats is None:
                    if check_sites is not None:
                        check_sites(sites)
                    found = stats_cache.load(kept, sites, fisher)
                    if found is not None:
                        bar.update(total)
                        bar.set_postfix_str(f"read from {kept}")
                        return CalibrationStats(sites, unmatched, **found)
                    recorder = _Recorder(len(sites), stride, fisher)
                    stats = CalibrationStats(sites, unmatched, recorder.grams, 0, {} if fisher else None,
                                             recorder.samples if fisher else None)
                elif [s.k_weight for s in sites] != [s.k_weight for s in stats.sites]:
                    raise RuntimeError(f"lrkv internal error: rows of {length} tokens trace to other sites")
                _instrument(gm, sites, recorder)
                traces[length] = (gm, [t.detach() if isinstance(t, torch.Tensor) else t for t in example_inputs],
                                  ids_index)
            gm, example_inputs, ids_index = traces[length]
            inputs = list(example_inputs)
            inputs[ids_index] = row
            if fisher:
                with torch.enable_grad():
                    logits = _logits(gm(*inputs), row, vocab_size).float()
                    loss = torch.nn.functional.cross_entropy(logits[0, :-1], row[0, 1:], reduction="sum")
                    keys = list(recorder.leaves)
                    grads = torch.autograd.grad(loss, [recorder.leaves[key] for key in keys])
                for key, grad in zip(keys, grads):
                    flat = grad.detach().reshape(-1, grad.shape[-1]).double().cpu()
                    stats.fisher[key] = flat.T @ flat + stats.fisher.get(key, 0)
            else:
                with torch.no_grad():
                    gm(*inputs)
            stats.tokens += row.numel()
            bar.update(length)
    if fisher:
        stats.samples[:] = [torch.cat(parts) for parts in stats.samples]
    if kept is not None:
        stats_cache.save(kept, stats)
    return stats


def _schemes(scheme, k_scheme, v_scheme):
    if scheme not in SCHEMES + tuple(HYBRID):
        raise PlanError(f"scheme={scheme!r}; choose one of {SCHEMES + tuple(HYBRID)}")
    for name, value in (("k_scheme", k_scheme), ("v_scheme", v_scheme)):
        if value is not None and value not in SCHEMES:
            raise PlanError(f"{name}={value!r}; choose one of {SCHEMES}")
    base_k, base_v = HYBRID.get(scheme, (scheme, scheme))
    return k_scheme or base_k, v_scheme or base_v


def _blocks(sites, k_scheme, v_scheme, group_size) -> dict:
    """{(site index, side): factor blocks}, or a PlanError naming the site and the user's value."""
    blocks = {}
    for site in sites:
        for side, scheme_name in (("k", k_scheme), ("v", v_scheme)):
            try:
                blocks[site.index, side] = blocks_for(scheme_name, site.num_kv_heads, group_size)
            except ValueError as error:
                raise PlanError(f"site {site.index} ({site.k_weight}): {error}") from None
    return blocks


def _exact(sinks, window) -> tuple[int, int]:
    """(sinks, window) with the defaults filled in, or a PlanError naming the user's value."""
    values = (DEFAULT_SINKS if sinks is None else sinks, DEFAULT_WINDOW if window is None else window)
    for name, value in zip(("sinks", "window"), values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"{name}={value!r} must be an integer >= 0 (tokens kept exact beside the quantized ones)")
    return values


def _layouts(bits, bits_k, bits_v, group, rotation, sinks, window, axis_k, axis_v, outliers_k, outliers_v) -> dict:
    """{"k": Layout, "v": Layout}: bits_k / bits_v override bits; quantized sides default to a Hadamard rotation
    and keep the sinks and window exact (16-bit sides hold every token exact); a channel-axis side's window
    is at least its group (the block it fills before quantizing it)."""
    layouts = {}
    for side, side_bits, axis, outliers in (("k", bits if bits_k is None else bits_k, axis_k or "token", outliers_k),
                                            ("v", bits if bits_v is None else bits_v, axis_v or "token", outliers_v)):
        exact = {} if side_bits == 16 else {"sinks": sinks, "window": max(window, group) if axis == "channel" else window}
        try:
            layouts[side] = Layout(bits=side_bits, group=group, axis=axis, outliers=outliers or 0,
                                   rotation=rotation or ("none" if side_bits == 16 else "hadamard"), **exact)
        except PlanError as error:
            raise PlanError(f"{side.upper()} latents: {error}") from None
    return layouts


def _factor(factors, blocks, rank, layout, seed):
    """The plan's factors of one side: its whitened SVD (`spectrum`) truncated to `rank`, then the layout's
    rotation fused in."""
    down, up = truncate(factors, rank)
    return rotate(down, up, layout.rotation, blocks, seed=seed, keep=layout.outliers)


def _budget_options(budget, method, options):
    """Validate the budget-mode arguments; the per-side layouts are the allocator's to choose."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not 0 < budget <= 1:
        raise PlanError(f"budget={budget!r} must be a number in (0, 1]: the fraction of a 16-bit K/V cache's bytes "
                        "the latent cache may take")
    if method not in METHODS and method != "none":
        raise PlanError(f"method={method!r}; choose one of {tuple(METHODS) + ('none',)}")
    chosen_by_budget = {"keep", "keep_k", "keep_v", "bits", "bits_k", "bits_v", "group", "axis_k", "axis_v",
                        "outliers_k", "outliers_v"}
    clash = sorted(name for name, value in options.items() if name in chosen_by_budget and value is not None)
    if clash:
        raise PlanError(f"{', '.join(clash)} cannot be combined with budget=: the budget's allocation chooses "
                        "ranks, bits, groups and scale axes per site; pass either budget= or keep= (and bits=)")


def build_plan(model, batches=None, keep=None, budget=None, method="search", context=DEFAULT_CONTEXT, scheme="joint",
               k_scheme=None, v_scheme=None, group_size=None, keep_k=None, keep_v=None, bits=None, bits_k=None,
               bits_v=None, group=None, axis_k=None, axis_v=None, outliers_k=None, outliers_v=None, rotation=None,
               sinks=None, window=None, rope_window=0, progress=True, stats=None) -> RankPlan:
    """Plan every attention site of `model`; see `calibrate` for the arguments. With `batches` (or `stats`),
    factors are activation-aware (whitened SVD); without, plain SVD of the weights."""
    check_context(context)
    rope_window = check_rope_window(rope_window)
    sinks, window = _exact(sinks, window)
    if budget is not None:
        _budget_options(budget, method, dict(keep=keep, keep_k=keep_k, keep_v=keep_v, bits=bits, bits_k=bits_k,
                                             bits_v=bits_v, group=group, axis_k=axis_k, axis_v=axis_v,
                                             outliers_k=outliers_k, outliers_v=outliers_v))
        if method != "none" and batches is None and stats is None:
            raise PlanError(f"method={method!r} measures each choice on calibration text: pass batches, or use "
                            "method='none' for an uncalibrated full-rank quantized plan")
        if method == "learned" and batches is None:
            raise PlanError("method='learned' trains rank thresholds on the calibration text: pass batches (with "
                            "stats= too, to reuse a pass over them)")
        layouts = None
    else:
        keep = check_keep(0.5 if keep is None else keep)
        keep_k = keep if keep_k is None else check_keep(keep_k, "keep_k")
        keep_v = keep if keep_v is None else check_keep(keep_v, "keep_v")
        layouts = _layouts(16 if bits is None else bits, bits_k, bits_v, 32 if group is None else group, rotation,
                           sinks, window, axis_k, axis_v, outliers_k, outliers_v)
    if rotation is not None and rotation not in ROTATIONS:
        raise PlanError(f"rotation={rotation!r}; choose one of {ROTATIONS}")
    k_scheme, v_scheme = _schemes(scheme, k_scheme, v_scheme)
    if group_size is None:
        group_size = DEFAULT_GROUP_SIZE
    elif isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise PlanError(f"group_size={group_size!r} must be a positive integer (heads per group)")
    fisher = budget is not None and method != "none"
    if stats is not None:
        check_stats(stats, "budget= with a method that measures" if fisher else None)
    if batches is not None:
        batches = as_batches(batches)  # read once: collect_stats and the learned method both use them
    if stats is None and batches is not None:
        stats = collect_stats(model, batches, progress, fisher=fisher,
                              check_sites=lambda sites: _blocks(sites, k_scheme, v_scheme, group_size))
    if stats is not None:
        sites, unmatched = stats.sites, stats.unmatched
    else:
        _, _, _, sites, unmatched = discover(model, torch.arange(8, device=next(model.parameters()).device)[None])
    blocks = _blocks(sites, k_scheme, v_scheme, group_size)
    if unmatched:
        warnings.warn(f"lrkv: {len(unmatched)} attention call(s) did not match and are left out of the plan "
                      f"(they stay full): {'; '.join(f'{u.node}: {u.reason}' for u in unmatched)}",
                      LrkvWarning, stacklevel=3)
    weights, spectra = side_spectra(model, sites, stats, blocks, progress)
    if budget is not None:
        full_bytes = sum(2 * 2 * site.num_kv_heads * site.head_dim for site in sites)
        choices = _allocate(sites, blocks, weights, spectra, stats, budget * full_bytes - POSITION_BYTES, full_bytes,
                            method, Layout(bits=2, rotation=rotation or "hadamard", sinks=sinks, window=window),
                            context, progress, model, batches)
    else:
        choices = _keep_choices(sites, blocks, layouts, keep_k, keep_v)
    schemes = {(site.index, side): scheme_name for site in sites for side, scheme_name in (("k", k_scheme),
                                                                                             ("v", v_scheme))}
    source = "uniform" if stats is None else "calibrated" if budget is None else f"calibrated: {method}"
    return RankPlan(sites=site_plans(model, sites, schemes, blocks, spectra, choices), source=source,
                    calibration_tokens=stats.tokens if stats is not None else 0, context=context,
                    rope_window=rope_window)


def side_spectra(model, sites, stats, blocks, progress) -> tuple[dict, dict]:
    """({(site index, side): weight [out, in]}, {(site index, side): whitened SVD}): each side's SVD once, from
    which every rank scored and planned is cut (plain SVD of the weights without `stats`)."""
    params = ProjectionWeights(model)
    weights = {(site.index, side): params[name].detach().float().cpu()
               for site in sites for side, name in (("k", site.k_weight), ("v", site.v_weight))}
    spectra = {}
    for site in tqdm(sites, desc="lrkv calibrate: factorize", disable=not progress, unit="site"):
        whitening = whitening_factor(stats.grams[site.index] / stats.tokens) if stats is not None else None
        for side in ("k", "v"):
            spectra[site.index, side] = spectrum(weights[site.index, side], whitening, blocks[site.index, side])
    return weights, spectra


def site_plans(model, sites, schemes, blocks, spectra, choices) -> tuple:
    """The SitePlans of `sites`: each side's scheme, blocks and (rank, layout) choice, its factors cut from its
    spectrum with the layout's rotation, and the fingerprints of the model's weights."""
    params = ProjectionWeights(model)
    planned = []
    for site in sites:
        factors = {}
        for side in ("k", "v"):
            rank, layout = choices[site.index, side]
            factors[f"down_{side}"], factors[f"up_{side}"] = _factor(
                spectra[site.index, side], blocks[site.index, side], rank, layout, site.index)
        planned.append(SitePlan(
            layer=site.layer, k_weight=site.k_weight, v_weight=site.v_weight, hidden_size=site.hidden_size,
            num_kv_heads=site.num_kv_heads, head_dim=site.head_dim, k_scheme=schemes[site.index, "k"],
            v_scheme=schemes[site.index, "v"], k_blocks=blocks[site.index, "k"], v_blocks=blocks[site.index, "v"],
            rank_k=choices[site.index, "k"][0], rank_v=choices[site.index, "v"][0],
            k_layout=choices[site.index, "k"][1], v_layout=choices[site.index, "v"][1],
            k_fingerprint=weight_fingerprint(params[site.k_weight]),
            v_fingerprint=weight_fingerprint(params[site.v_weight]), **factors))
    return tuple(planned)


def _keep_choices(sites, blocks, layouts, keep_k, keep_v) -> dict:
    """{(site, side): (rank, layout)} for a keep= plan: the same fraction and layout everywhere."""
    choices = {}
    for site in sites:
        for side, side_keep in (("k", keep_k), ("v", keep_v)):
            side_blocks, layout = blocks[site.index, side], layouts[side]
            if layout.outliers and side_blocks != 1:
                raise PlanError(f"outliers_{side}={layout.outliers} needs a joint-scheme side (one block of latent "
                                f"channels); {side.upper()} is split into {side_blocks} blocks by its scheme")
            # a side quantized per token has a rank of whole quantization groups (per channel: any rank)
            per_token = layout.bits != 16 and layout.axis == "token"
            multiple = math.lcm(side_blocks, layout.group) if per_token else side_blocks
            full = site.num_kv_heads * site.head_dim
            if multiple > min(full, site.hidden_size):
                raise PlanError(f"group={layout.group} on {side.upper()} (per-token scales) needs a rank that is a "
                                f"multiple of {multiple}, but site {site.index} has only {min(full, site.hidden_size)} "
                                f"{side.upper()} channels: pick a group that divides the rank you want, or "
                                f"axis_{side}='channel'")
            rank = rank_for(side_keep, full, site.hidden_size, multiple)
            asked = side_keep * full
            if multiple > side_blocks and abs(rank - asked) >= side_blocks and site.index == 0:
                warnings.warn(f"lrkv: keep_{side}={side_keep} asks for rank {asked:g}; a whole number of quantization "
                              f"groups (group={layout.group}, rank a multiple of {multiple}) gives rank {rank}: "
                              "pick a group that divides the rank you want", LrkvWarning, stacklevel=4)
            choices[site.index, side] = (rank, layout)
    return choices


def _full_rank(sites, latent_bytes, full_bytes, base: Layout, context) -> dict:
    """{(site, side): (rank, layout)}: full rank everywhere, at the most bits (then the smallest group) that fit."""
    full = [min(site.num_kv_heads * site.head_dim, site.hidden_size) for site in sites]
    fitting = []
    for bits in CANDIDATE_BITS:
        for group in CANDIDATE_GROUPS:
            if any(rank % group for rank in full):
                continue
            layout = replace(base, bits=bits, group=group)
            spent = 2 * sum(layout.bytes_per_token(rank, context) for rank in full)
            fitting.append((spent <= latent_bytes, bits, -group, spent, layout))
    if not any(fits for fits, *_ in fitting):
        smallest = min(spent for _, _, _, spent, _ in fitting)
        raise PlanError(f"budget={(latent_bytes + POSITION_BYTES) / full_bytes:.4g} is below what a full-rank plan can "
                        f"reach, {(smallest + POSITION_BYTES) / full_bytes:.4f} (2-bit latents); calibrate on text for "
                        "lower budgets (method='search' with batches: lower ranks)")
    layout = max(f for f in fitting if f[0])[-1]
    return {(site.index, side): (rank, layout) for site, rank in zip(sites, full) for side in ("k", "v")}


def _allocate(sites, blocks, weights, spectra, stats, latent_bytes, full_bytes, method, base: Layout, context,
              progress, model, batches) -> dict:
    """{(site, side): (rank, layout)} under `latent_bytes` per token at `context` tokens, by `method` (see
    `lrkv_compile.allocate`); every layout has the rotation, sinks and window of `base`. `model` and
    `batches` are for the learned method's training."""
    keys = [(site, side) for site in sites for side in ("k", "v")]

    def ranks(site, side):
        full = site.num_kv_heads * site.head_dim
        return candidate_ranks(full, site.hidden_size, blocks[site.index, side])

    if method == "none":
        return _full_rank(sites, latent_bytes, full_bytes, base, context)
    lowest = {(site.index, side): ranks(site, side)[0] for site, side in keys}
    cheapest = sum(replace(base, group=rank).bytes_per_token(rank, context) for rank in lowest.values())
    if cheapest > latent_bytes:
        raise PlanError(f"budget={(latent_bytes + POSITION_BYTES) / full_bytes:.4g} is below the smallest this model "
                        f"can reach at context={context} with sinks={base.sinks} and window={base.window}, "
                        f"{(cheapest + POSITION_BYTES) / full_bytes:.4f} (every site at its lowest rank and 2 bits); "
                        "ask for at least that")
    options = {}
    for site, side in tqdm(keys, desc="lrkv calibrate: score ranks and bits", disable=not progress, unit="side"):
        weight = weights[site.index, side]
        samples = stats.samples[site.index]
        fisher = stats.fisher[site.index, side] / stats.tokens

        def factor(rank, layout, site=site, side=side):
            return _factor(spectra[site.index, side], blocks[site.index, side], rank, layout, site.index)

        key = (site.index, side, blocks[site.index, side], base.rotation)
        if key not in stats.scored:
            outliers = (0, *OUTLIER_CHANNELS) if blocks[site.index, side] == 1 else (0,)
            stats.scored[key] = score(factor, samples, samples @ weight.T, fisher.float(), ranks(site, side),
                                      base.rotation, outliers)
        options[site.index, side] = [with_exact(candidate, base.sinks, base.window, context)
                                     for candidate in stats.scored[key]]
    allocate = METHODS[method]
    if method == "fisher":
        # Palu's importance: the summed Fisher information of the weight, E[(dL/dW)^2] summed over W, here in its
        # Kronecker-factored estimate trace(E[g g^T]) trace(E[x x^T]) from the statistics already collected
        allocate = partial(allocate, importance={
            (site.index, side): float(stats.fisher[site.index, side].trace() * stats.grams[site.index].trace())
            for site, side in keys})
    if method == "learned":
        total_rank = sum(candidate.rank for candidate in search(options, latent_bytes).values())
        ranks = learn_ranks(model, batches, stats, {key: blocks[key] for key in options},
                            {key: sorted({c.rank for c in found}) for key, found in options.items()}, total_rank,
                            progress=progress)
        allocate = partial(allocate, ranks=ranks)
    chosen = allocate(options, latent_bytes)
    return {key: (candidate.rank, candidate.layout) for key, candidate in chosen.items()}


def calibrate(model, batches=None, keep=None, budget=None, method="search", **options) -> RankPlan:
    """A plan for `model`: ranks and layouts of every attention site's K/V latents, with their factors.

    batches: token-id tensors of real text ([batch, tokens] or [tokens], or a list or iterator of them).
    budget: the fraction of a 16-bit K/V cache's bytes the latent cache may take for a sequence of `context`
    tokens (default 4096), whatever the model's dtype: everything it stores counts (latents, scales, zero
    points, positions, and the exact sink and window tokens, amortised over the context). `method` chooses
    each site's K and V rank, bits and quantization group under it (`lrkv_compile.allocate`): "search"
    (default) minimises the estimated loss; "uniform" uses one setting for every site; "fisher" gives ranks
    in proportion to each projection's Fisher information (Palu) at one bit width; "learned" trains soft rank
    thresholds by distillation (STAR-KV) at the rank the search spends, then searches bits; "none" needs no
    batches and gives a full-rank plan quantized to the widest bits that fit. `plan.budget` reports what
    was reached (at most the request).
    keep (instead of budget): fraction of the K/V channels the latents keep (rank / full dimension), the
    same everywhere, with keep_k / keep_v (separate K and V fractions), bits (16 = unquantized, 8, 4, 3,
    2) or bits_k / bits_v, group (values per quantization scale, default 32; per token it must divide the
    rank), axis_k / axis_v ("token", the default: a scale per group of a token's latent channels; "channel":
    a scale per latent channel and block of `group` tokens, as KIVI quantizes keys, with the window raised
    to at least `group`), outliers_k / outliers_v (leading latent channels, the largest singular directions,
    kept in float16 beside the quantized rest, which alone is rotated; joint-scheme sides only). keep=0.5
    when neither is given. Budget plans choose the axis and outliers per side and site.
    Both: scheme ("joint", "head", "group", "hybrid" = head-wise K + joint V), k_scheme / v_scheme,
    group_size (heads per group for "group", default 4), rotation ("hadamard", the default for quantized
    sides, "orthogonal", "none"), sinks and window (the first `sinks` tokens and the most recent `window`
    ones of a sequence are also held exact in 16 bits on quantized sides; defaults 4 and 0), rope_window
    (windowed RoPE beyond this many tokens, `RankPlan.rope_window`; default 0, exact RoPE), progress,
    stats (`collect_stats` on the same model, to make many plans from one pass over the text; budget
    plans need it with fisher=True).
    """
    if keep is not None and budget is not None:
        raise PlanError("pass keep= or budget=, not both")
    if batches is None and options.get("stats") is None and not (budget is not None and method == "none"):
        raise PlanError("calibrate needs token batches of real text; use RankPlan.uniform for an uncalibrated plan, "
                        "or budget=... with method='none'")
    return build_plan(model, batches, keep=keep, budget=budget, method=method, **options)
