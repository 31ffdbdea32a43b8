"""The `lrkv` torch.compile backend: find attention sites in the Dynamo graph, rewrite them per the plan.

    model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
"""
import warnings
from pathlib import Path

from lrkv_compile.lowering import ops  # noqa: F401  (registers torch.ops.lrkv.*)
from lrkv_compile.passes.rewrite import PlanMismatch, rewrite
from lrkv_compile.passes.sites import find_sites
from .errors import PlanError, PlanMismatchError
from .plan import RankPlan

OPTIONS = {"plan": "RankPlan or path of a saved plan (required)",
           "value_path": "'auto' (by cost), 'absorb' (into the output projection) or 'up' (after the reduction)"}
_POLICY = {"auto": "auto", "absorb": "always", "up": "never"}
reports = []  # SiteReports of every graph compiled in this process, newest last
_warned_stock_cache = False


def _resolve_plan(options) -> tuple[RankPlan, str]:
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise PlanError(f"unknown lrkv option(s) {sorted(unknown)}; known: {OPTIONS}")
    plan = options.get("plan")
    if plan is None:
        raise PlanError("backend='lrkv' needs a plan: torch.compile(..., backend='lrkv', options={'plan': plan})")
    if isinstance(plan, (str, Path)):
        plan = RankPlan.load(plan)
    if not isinstance(plan, RankPlan):
        raise PlanError(f"options['plan'] must be a RankPlan or a path, got {type(plan).__name__}")
    policy = options.get("value_path", "auto")
    if policy not in _POLICY:
        raise PlanError(f"options['value_path']={policy!r}; choose one of {sorted(_POLICY)}")
    return plan, _POLICY[policy]


def lrkv_backend(gm, example_inputs, options=None, **_):
    """Dynamo backend entry point (registered as 'lrkv' through the torch_dynamo_backends entry point)."""
    global _warned_stock_cache
    plan, policy = _resolve_plan(dict(options or {}))
    sites, unmatched = find_sites(gm)
    for miss in unmatched:
        warnings.warn(f"lrkv: attention at {miss.node} left untouched: {miss.reason}", stacklevel=2)
    try:
        site_reports = rewrite(gm, sites, plan, example_inputs, policy)
    except PlanMismatch as error:
        raise PlanMismatchError(f"the plan does not fit this model: {error}") from None
    reports.append(site_reports)
    if not _warned_stock_cache and any(r.cache == "concat" and r.status == "rewritten" for r in site_reports):
        _warned_stock_cache = True
        warnings.warn("lrkv: the model runs with a stock transformers cache, which stores full keys and values: "
                      "results follow the plan but cache memory is NOT reduced. Pass "
                      "past_key_values=lrkv.LatentCache(model, plan, ...) to store latents.", stacklevel=2)
    return gm.forward
