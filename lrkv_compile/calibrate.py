"""Build rank plans: discover sites, gather activation statistics, factorize per scheme and keep.

Every input is validated before the model is traced or run; the model is traced once per row length
(one trace for the usual equal-length rows), and that trace both names the sites and records their inputs.
"""
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from lrkv_compile.passes.factorize import SCHEMES, blocks_for, factorize, rotate, whitening_factor
from lrkv_compile.passes.sites import find_sites
from .errors import LrkvWarning, PlanError
from .plan import Layout, RankPlan, SitePlan, check_keep, rank_for, weight_fingerprint
from .trace import capture

HYBRID = {"hybrid": ("head", "joint")}  # STAR-KV: head-wise keys, joint values
DEFAULT_GROUP_SIZE = 4  # Palu's default group of heads for G-LRD


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
    """What one pass over the calibration text gives: the sites (from the trace) and each site's K/V input
    Gram x^T x (float64, summed over `tokens` tokens)."""
    sites: list
    unmatched: list
    grams: list
    tokens: int


class _GramRecorder:
    """Accumulates x^T x (float64) of each site's K/V input, called from inside the traced graph."""

    def __init__(self, count):
        self.grams = [None] * count

    def record(self, site_index, x):
        flat = x.detach().reshape(-1, x.shape[-1]).double().cpu()
        gram = flat.T @ flat
        self.grams[site_index] = gram if self.grams[site_index] is None else self.grams[site_index] + gram
        return x


def _instrument(gm, sites, recorder):
    for site in sites:
        with gm.graph.inserting_after(site.key.x):
            recorded = gm.graph.call_function(recorder.record, (site.index, site.key.x))
        site.key.x.replace_all_uses_with(recorded, delete_user_cb=lambda user: user is not recorded)
    gm.recompile()


def collect_grams(model, batches, progress=True, check_sites=None) -> CalibrationStats:
    """Input Gram matrices of every site's K/V projections over the calibration rows, one row per step.

    check_sites(sites), if given, runs after the first trace and before any row is run.
    """
    rows = [row[None] for batch in as_batches(batches) for row in batch]
    device = next(model.parameters()).device
    traces, stats, recorder = {}, None, None
    total = sum(row.shape[1] for row in rows)
    bar = tqdm(total=total, desc="lrkv calibrate: activations", disable=not progress, unit="tok")
    with bar:
        for row in rows:
            row = row.to(device)
            length = row.shape[1]
            if length not in traces:
                gm, example_inputs, ids_index, sites, unmatched = discover(model, row)
                if stats is None:
                    if check_sites is not None:
                        check_sites(sites)
                    recorder = _GramRecorder(len(sites))
                    stats = CalibrationStats(sites, unmatched, recorder.grams, 0)
                elif [s.k_weight for s in sites] != [s.k_weight for s in stats.sites]:
                    raise RuntimeError(f"lrkv internal error: rows of {length} tokens trace to other sites")
                _instrument(gm, sites, recorder)
                traces[length] = (gm, example_inputs, ids_index)
            gm, example_inputs, ids_index = traces[length]
            inputs = list(example_inputs)
            inputs[ids_index] = row
            with torch.no_grad():
                gm(*inputs)
            stats.tokens += row.numel()
            bar.update(length)
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


def _layouts(bits, bits_k, bits_v, group, rotation) -> dict:
    """{"k": Layout, "v": Layout}: bits_k / bits_v override bits; quantized sides default to a Hadamard rotation."""
    layouts = {}
    for side, side_bits in (("k", bits if bits_k is None else bits_k), ("v", bits if bits_v is None else bits_v)):
        try:
            layouts[side] = Layout(bits=side_bits, group=group,
                                   rotation=rotation or ("none" if side_bits == 16 else "hadamard"))
        except PlanError as error:
            raise PlanError(f"{side.upper()} latents: {error}") from None
    return layouts


def build_plan(model, batches=None, keep=0.5, scheme="joint", k_scheme=None, v_scheme=None, group_size=None,
               keep_k=None, keep_v=None, bits=16, bits_k=None, bits_v=None, group=32, rotation=None, progress=True,
               grams=None) -> RankPlan:
    """Plan every attention site of `model`. With `batches`, factors are activation-aware (whitened SVD).

    grams: a `CalibrationStats` from `collect_grams` on the same model, to factorize many plans from one pass.
    """
    keep = check_keep(keep)
    keep_k = keep if keep_k is None else check_keep(keep_k, "keep_k")
    keep_v = keep if keep_v is None else check_keep(keep_v, "keep_v")
    layouts = _layouts(bits, bits_k, bits_v, group, rotation)
    k_scheme, v_scheme = _schemes(scheme, k_scheme, v_scheme)
    if group_size is None:
        group_size = DEFAULT_GROUP_SIZE
    elif isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise PlanError(f"group_size={group_size!r} must be a positive integer (heads per group)")
    if grams is not None and not isinstance(grams, CalibrationStats):
        raise PlanError(f"grams must be the CalibrationStats that collect_grams returns, got {type(grams).__name__}")
    if grams is None and batches is not None:
        grams = collect_grams(model, batches, progress,
                              check_sites=lambda sites: _blocks(sites, k_scheme, v_scheme, group_size))
    if grams is not None:
        sites, unmatched = grams.sites, grams.unmatched
    else:
        _, _, _, sites, unmatched = discover(model, torch.arange(8, device=next(model.parameters()).device)[None])
    blocks = _blocks(sites, k_scheme, v_scheme, group_size)
    if unmatched:
        warnings.warn(f"lrkv: {len(unmatched)} attention call(s) did not match and are left out of the plan "
                      f"(they stay full): {'; '.join(f'{u.node}: {u.reason}' for u in unmatched)}",
                      LrkvWarning, stacklevel=3)
    params = dict(model.named_parameters())
    rope_groups = {}
    planned = []
    for site in tqdm(sites, desc="lrkv calibrate: factorize", disable=not progress, unit="site"):
        whitening = whitening_factor(grams.grams[site.index] / grams.tokens) if grams is not None else None
        factors, ranks = {}, {}
        for side, side_keep, weight in (("k", keep_k, site.k_weight), ("v", keep_v, site.v_weight)):
            side_blocks, layout = blocks[site.index, side], layouts[side]
            # a quantized side's rank is a whole number of quantization groups
            multiple = side_blocks if layout.bits == 16 else math.lcm(side_blocks, layout.group)
            ranks[side] = rank_for(side_keep, site.num_kv_heads * site.head_dim, site.hidden_size, multiple)
            asked = side_keep * site.num_kv_heads * site.head_dim
            if multiple > side_blocks and abs(ranks[side] - asked) >= side_blocks and site.index == 0:
                warnings.warn(f"lrkv: keep_{side}={side_keep} asks for rank {asked:g}; a whole number of quantization "
                              f"groups (group={layout.group}, rank a multiple of {multiple}) gives rank {ranks[side]}: "
                              "pick a group that divides the rank you want", LrkvWarning, stacklevel=3)
            down, up = factorize(params[weight].detach().float().cpu(), whitening, side_blocks, ranks[side])
            factors[f"down_{side}"], factors[f"up_{side}"] = rotate(down, up, layout.rotation, side_blocks,
                                                                    seed=site.index)
        rope_group = rope_groups.setdefault(site.rope_key, len(rope_groups))
        planned.append(SitePlan(
            layer=site.index, k_weight=site.k_weight, v_weight=site.v_weight, hidden_size=site.hidden_size,
            num_kv_heads=site.num_kv_heads, head_dim=site.head_dim, k_scheme=k_scheme, v_scheme=v_scheme,
            k_blocks=blocks[site.index, "k"], v_blocks=blocks[site.index, "v"], rank_k=ranks["k"], rank_v=ranks["v"],
            k_layout=layouts["k"], v_layout=layouts["v"], rope_group=rope_group,
            k_fingerprint=weight_fingerprint(params[site.k_weight]),
            v_fingerprint=weight_fingerprint(params[site.v_weight]), **factors))
    return RankPlan(sites=tuple(planned), source="calibrated" if grams is not None else "uniform",
                    calibration_tokens=grams.tokens if grams is not None else 0)


def calibrate(model, batches, keep=0.5, **options) -> RankPlan:
    """Calibrated plan: whitened (activation-aware) SVD of every site's K/V projections.

    batches: token-id tensors of real text ([batch, tokens] or [tokens], or a list or iterator of them).
    keep: fraction of the K/V channels the latents keep (rank / full dimension). Options: scheme ("joint",
    "head", "group", "hybrid" = head-wise K + joint V), k_scheme / v_scheme, group_size (heads per
    group for "group", default 4), keep_k / keep_v (separate K and V fractions), bits (16 = unquantized,
    8, 4, 3, 2) or bits_k / bits_v, group (latent channels per quantization scale, default 32; it must
    divide the rank), rotation ("hadamard", the default for quantized sides, "orthogonal", "none"),
    progress, grams (the result of `collect_grams` on the same model, to factorize many plans from one
    pass over the text). `plan.budget` reports the bytes kept against a 16-bit cache.
    """
    if batches is None:
        raise PlanError("calibrate needs token batches of real text; use RankPlan.uniform for an uncalibrated plan")
    return build_plan(model, batches, keep=keep, **options)
