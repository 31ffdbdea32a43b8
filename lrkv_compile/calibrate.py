"""Build rank plans: discover sites, gather activation statistics, factorize per scheme and keep."""
import torch
from tqdm.auto import tqdm

from lrkv_compile.passes.factorize import blocks_for, factorize, whitening_factor
from lrkv_compile.passes.sites import find_sites
from .errors import PlanError
from .plan import RankPlan, SitePlan, rank_for
from .trace import capture

HYBRID = {"hybrid": ("head", "joint")}  # STAR-KV: head-wise keys, joint values


def as_batches(batches) -> list[torch.Tensor]:
    """Accept a [batch, tokens] tensor, a [tokens] tensor, or a list of either; return a list of 2-D tensors."""
    if isinstance(batches, torch.Tensor):
        batches = [batches]
    out = []
    for position, batch in enumerate(batches):
        if not isinstance(batch, torch.Tensor) or batch.dtype not in (torch.int32, torch.int64):
            raise PlanError(f"calibration batch {position} must be an integer tensor of token ids")
        if batch.dim() == 1:
            batch = batch[None]
        if batch.dim() != 2 or batch.shape[1] < 2:
            raise PlanError(f"calibration batch {position} has shape {tuple(batch.shape)}; expected [batch, tokens]")
        out.append(batch)
    if not out:
        raise PlanError("no calibration batches given")
    return out


def discover(model, input_ids):
    gm, example_inputs, ids_index, name_of = capture(model, input_ids)
    sites, unmatched = find_sites(gm, name_of)
    if not sites:
        reasons = "; ".join(f"{u.node}: {u.reason}" for u in unmatched) or "the graph has no SDPA call"
        raise PlanError(f"no attention site of this model matched ({reasons}); lrkv cannot plan it")
    return gm, example_inputs, ids_index, sites, unmatched


class _GramRecorder:
    """Accumulates x^T x (float64) of each site's K/V input, called from inside the traced graph."""

    def __init__(self, count):
        self.grams = [None] * count
        self.tokens = 0

    def record(self, site_index, x):
        flat = x.detach().reshape(-1, x.shape[-1]).double().cpu()
        gram = flat.T @ flat
        self.grams[site_index] = gram if self.grams[site_index] is None else self.grams[site_index] + gram
        return x


def collect_grams(model, batches, progress=True):
    """Input Gram matrices of every site's K/V projections over the calibration batches."""
    batches = as_batches(batches)
    device = next(model.parameters()).device
    shapes = {}
    recorder = None
    for batch in tqdm(batches, desc="lrkv calibrate: activations", disable=not progress, unit="batch"):
        batch = batch.to(device)
        key = tuple(batch.shape)
        if key not in shapes:
            gm, example_inputs, ids_index, sites, _ = discover(model, batch)
            recorder = recorder or _GramRecorder(len(sites))
            for site in sites:
                with gm.graph.inserting_after(site.key.x):
                    recorded = gm.graph.call_function(recorder.record, (site.index, site.key.x))
                site.key.x.replace_all_uses_with(recorded, delete_user_cb=lambda user: user is not recorded)
            gm.recompile()
            shapes[key] = (gm, example_inputs, ids_index)
        gm, example_inputs, ids_index = shapes[key]
        inputs = list(example_inputs)
        inputs[ids_index] = batch
        with torch.no_grad():
            gm(*inputs)
        recorder.tokens += batch.numel()
    return recorder.grams, recorder.tokens


def build_plan(model, batches=None, keep=0.5, scheme="joint", k_scheme=None, v_scheme=None, group_size=None,
               keep_k=None, keep_v=None, progress=True, grams=None) -> RankPlan:
    """Plan every attention site of `model`. With `batches`, factors are activation-aware (whitened SVD)."""
    base_k, base_v = HYBRID.get(scheme, (scheme, scheme))
    k_scheme, v_scheme = k_scheme or base_k, v_scheme or base_v
    keep_k = keep if keep_k is None else keep_k
    keep_v = keep if keep_v is None else keep_v
    probe = as_batches(batches)[0][:1, :16] if batches is not None else torch.arange(8)[None]
    _, _, _, sites, unmatched = discover(model, probe.to(next(model.parameters()).device))
    if grams is None and batches is not None:
        grams = collect_grams(model, batches, progress)
    grams, tokens = grams if grams is not None else (None, 0)
    params = dict(model.named_parameters())
    rope_groups = {}
    planned = []
    for site in tqdm(sites, desc="lrkv calibrate: factorize", disable=not progress, unit="site"):
        whitening = whitening_factor(grams[site.index] / tokens) if grams is not None else None
        group = group_size or 4  # Palu's default group of heads for G-LRD
        factors, ranks, blocks = {}, {}, {}
        for side, scheme_name, side_keep, weight in (("k", k_scheme, keep_k, site.k_weight),
                                                     ("v", v_scheme, keep_v, site.v_weight)):
            try:
                blocks[side] = blocks_for(scheme_name, site.num_kv_heads, group)
            except ValueError as error:
                raise PlanError(f"site {site.index} ({weight}): {error}") from error
            full_dim = site.num_kv_heads * site.head_dim
            ranks[side] = rank_for(side_keep, full_dim, site.hidden_size, blocks[side])
            factors[f"down_{side}"], factors[f"up_{side}"] = factorize(
                params[weight].detach().float().cpu(), whitening, blocks[side], ranks[side])
        rope_group = rope_groups.setdefault(site.rope_key, len(rope_groups))
        planned.append(SitePlan(
            layer=site.index, k_weight=site.k_weight, v_weight=site.v_weight, hidden_size=site.hidden_size,
            num_kv_heads=site.num_kv_heads, head_dim=site.head_dim, k_scheme=k_scheme, v_scheme=v_scheme,
            k_blocks=blocks["k"], v_blocks=blocks["v"], rank_k=ranks["k"], rank_v=ranks["v"],
            rope_group=rope_group, **factors))
    return RankPlan(sites=tuple(planned), source="calibrated" if grams is not None else "uniform",
                    calibration_tokens=tokens)


def calibrate(model, batches, keep=0.5, **options) -> RankPlan:
    """Calibrated plan: whitened (activation-aware) SVD of every site's K/V projections.

    batches: token-id tensors of real text ([batch, tokens] or [tokens], or a list of them).
    keep: fraction of the full K/V cache kept (0.5 = a 2x smaller cache). Options: scheme ("joint",
    "head", "group", "hybrid" = head-wise K + joint V), k_scheme / v_scheme, group_size (heads per
    group for "group"), keep_k / keep_v (separate K and V fractions), progress, grams (the result of
    `collect_grams` on the same batches, to factorize many plans from one pass over the text).
    """
    if batches is None:
        raise PlanError("calibrate needs token batches of real text; use RankPlan.uniform for an uncalibrated plan")
    return build_plan(model, batches, keep=keep, **options)
