"""Whether a plan fits a model: the one check the backend, LatentCache, explain and the reference use.

Two levels of evidence, one set of rules:
- `check_parameters(plan, model)`: no trace; every planned K/V weight exists with the planned shape.
- `check_sites(plan, sites, unmatched)`: the sites matched in a traced graph carry the plan's signatures.
`check(model, plan)` runs both on the graph a LatentCache prefill gives, outside torch.compile, so its
errors arrive as lrkv's own types (inside torch.compile Dynamo wraps them in BackendCompilerFailed).
"""
import warnings

import torch

from .errors import LrkvWarning, PlanError, PlanMismatchError, UnrewrittenSiteError
from .plan import RankPlan, weight_fingerprint
from .weights import ProjectionWeights

_REMAKE = ("make the plan on this model (lrkv.calibrate or lrkv.RankPlan.uniform), or carry this one over to it "
           "with lrkv.transfer(plan, model, batches) (`lrkv transfer PLAN --model PATH -o OUT`)")


def _listed(items, limit=4) -> str:
    items = list(items)
    return "; ".join(map(str, items[:limit])) + (f"; and {len(items) - limit} more" if len(items) > limit else "")


FINGERPRINT_TOLERANCE = 2e-3  # relative; dtype casts stay far below, another checkpoint far above


def _fingerprint_difference(planned: tuple, weight) -> float:
    found = torch.tensor(weight_fingerprint(weight), dtype=torch.float64)
    planned = torch.tensor(planned, dtype=torch.float64)
    return float((found - planned).norm() / planned.norm().clamp_min(1e-30))


def check_parameters(plan: RankPlan, model) -> None:
    """Every planned K/V weight exists in `model` as [num_kv_heads * head_dim, hidden_size] and holds the
    values the plan's factors were made from (by fingerprint)."""
    if not isinstance(plan, RankPlan):
        raise PlanError(f"plan must be a RankPlan, got {type(plan).__name__}")
    params = ProjectionWeights(model)
    problems = []
    for site in plan.sites:
        expected = (site.full_dim, site.hidden_size)
        for name in (site.k_weight, site.v_weight):
            if name not in params:
                problems.append(f"layer {site.layer}: the model has no parameter {name!r}")
            elif tuple(params[name].shape) != expected:
                problems.append(f"layer {site.layer}: {name} has shape {tuple(params[name].shape)}, "
                                f"the plan expects {expected}")
    if not problems:
        for site in plan.sites:
            for name, fingerprint in ((site.k_weight, site.k_fingerprint), (site.v_weight, site.v_fingerprint)):
                difference = _fingerprint_difference(fingerprint, params[name]) if fingerprint else 0.0
                if difference > FINGERPRINT_TOLERANCE:
                    problems.append(f"layer {site.layer}: {name} holds other values than the weight the plan was "
                                    f"made from (relative difference {difference:.3g}): another checkpoint, e.g. "
                                    "a fine-tune")
    if problems:
        raise PlanMismatchError(f"the plan does not fit this model: {_listed(problems)}; {_REMAKE}")


def check_sites(plan: RankPlan, sites, unmatched, whole_model: bool = True) -> list:
    """Compare the plan with the sites matched in a graph. Raises PlanMismatchError where a planned site
    differs or is absent, UnrewrittenSiteError where it is among the attention the matcher could not
    handle or the graph has no SDPA call at all (a warning for a graph that may be a fragment of the
    model's forward); returns the matched sites the plan does not cover (they stay full)."""
    where = "the model's graph" if whole_model else "the compiled graph"
    if not sites and not unmatched:
        message = (f"{where} has no attention lrkv knows (a scaled_dot_product_attention call, or the eager "
                   "softmax(q k^T) v), so lrkv rewrites nothing and the model runs uncompressed: load the model "
                   "with attn_implementation='sdpa'")
        if whole_model:
            raise UnrewrittenSiteError(message)
        warnings.warn(f"lrkv: {message} (if this graph is a fragment of the forward without attention, "
                      "ignore this)", LrkvWarning, stacklevel=3)
        return []
    by_weight = {site.k_weight: site for site in sites}
    problems = [f"layer {planned.layer} ({planned.k_weight}): " + ", ".join(differences)
                for planned in plan.sites if planned.k_weight in by_weight
                for differences in [planned.signature.differences(by_weight[planned.k_weight].signature)]
                if differences]
    if problems:
        raise PlanMismatchError(f"the plan does not fit this model: {_listed(problems)}; {_REMAKE}")
    missing = [planned for planned in plan.sites if planned.k_weight not in by_weight]
    if missing and unmatched:
        raise UnrewrittenSiteError(
            f"planned layers {[p.layer for p in missing]} did not match in {where}, so they would run "
            f"uncompressed; attention the matcher could not handle: "
            f"{_listed(f'{u.node}: {u.reason}' for u in unmatched)}. lrkv.explain(model) lists every site")
    if missing and sites:
        raise PlanMismatchError(f"{where} has no attention site reading {_listed(p.k_weight for p in missing)}: "
                                "the plan was made for another model, or a graph break split the forward "
                                f"(compile with fullgraph=True, or use lrkv.compile); {_REMAKE}")
    if plan.rope_window:
        _check_rope_window(plan, [site for site in sites if plan.site_for(site.k_weight) is not None])
    return [site for site in sites if plan.site_for(site.k_weight) is None]


def _check_rope_window(plan: RankPlan, planned_sites) -> None:
    """PlanMismatchError where a site cannot run the plan's windowed RoPE: the latent ops compute it, so a stock
    cache (or none) cannot, and they turn queries by angles computed from the RoPE frequencies, which a model whose
    cos/sin come from a table or change as it runs does not give."""
    stock = [site.layer for site in planned_sites if site.cache != "latent"]
    if stock:
        raise PlanMismatchError(
            f"the plan's windowed RoPE (rope_window={plan.rope_window}) is computed by the latent cache's attention, "
            f"and layers {stock} run with a stock cache (or none): pass a LatentCache (cache=lrkv.LatentCache(model, "
            "plan, ...), past_key_values= before transformers 5.24), or use a plan with rope_window=0")
    other = [site.layer for site in planned_sites
             if site.rope_source is not None and (site.rope_source.rows or site.rope_source.table is not None)]
    if other:
        raise PlanMismatchError(
            f"the plan's windowed RoPE (rope_window={plan.rope_window}) needs RoPE computed from fixed frequencies, "
            f"and layers {other} take their cos/sin from a table or recompute their frequencies as they run; use a "
            "plan with rope_window=0 for this model")


def qualify_names(plan: RankPlan, sites) -> None:
    """Give sites the plan's names of their weights where the graph names them from an inner module: after a graph
    break, Dynamo traces the rest of an inner forward (a dynamic-NTK RoPE: `rotary.py`) in a frame whose `self` is
    the inner model, so its parameters read layers.0.self_attn.k_proj.weight where the plan has
    model.layers.0.self_attn.k_proj.weight. A site takes the planned name that ends with its own, when exactly one
    does."""
    planned = [site.k_weight for site in plan.sites]
    for site in sites:
        found = [name for name in planned if name.endswith("." + site.k_weight)]
        if site.k_weight in planned or len(found) != 1:
            continue
        prefix = found[0][:-len(site.k_weight)]
        site.k_weight, site.v_weight = prefix + site.k_weight, prefix + site.v_weight
        site.k_bias = site.k_bias and prefix + site.k_bias
        site.v_bias = site.v_bias and prefix + site.v_bias


def warn_left_full(left_full) -> None:
    if left_full:
        warnings.warn(f"lrkv: layers {[site.layer for site in left_full]} are not in the plan and stay full "
                      f"(uncompressed): {_listed(site.k_weight for site in left_full)}", LrkvWarning, stacklevel=3)


def model_layers(model) -> int:
    """Number of decoder layers the model's (text) config declares."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def trace_sites(model, plan: RankPlan = None):
    """(sites, unmatched) of the graph the backend will see: a prefill through a LatentCache of `plan`
    (without a cache when there is no plan)."""
    from .cache import LatentCache
    from .trace import capture
    from lrkv_compile.passes.sites import find_sites
    probe = torch.arange(8, device=next(model.parameters()).device)[None]
    cache = None
    if plan is not None:
        with warnings.catch_warnings():  # a probe's cache: its size says nothing about the user's
            warnings.simplefilter("ignore", LrkvWarning)
            cache = LatentCache(model, plan, max_batch_size=1, max_cache_len=16)
    gm, _, _, name_of = capture(model, probe, cache=cache)
    return find_sites(gm, name_of)


def check(model, plan: RankPlan) -> list:
    """Pre-flight: raise lrkv's documented errors if `plan` does not fit `model` as generation will run it,
    warn about layers left full. Returns the matched sites."""
    check_parameters(plan, model)
    sites, unmatched = trace_sites(model, plan)
    warn_left_full(check_sites(plan, sites, unmatched))
    return sites
