"""The `lrkv` torch.compile backend: find attention sites in the Dynamo graph, rewrite them per the plan.

    model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})

Errors raised here reach the caller wrapped in Dynamo's `BackendCompilerFailed` (the lrkv error is its
`inner_exception`); `lrkv.check(model, plan)` and `lrkv.compile(model, plan)` raise them unwrapped.
"""
import importlib.metadata
import logging
import warnings
from pathlib import Path

import torch

from lrkv_compile.lowering import ops  # noqa: F401  (registers torch.ops.lrkv.*)
from lrkv_compile.lowering.lower import lower
from lrkv_compile.lowering.ops import IMPLEMENTATIONS
from lrkv_compile.passes.canonicalize import canonicalize
from lrkv_compile.passes.rewrite import rewrite
from lrkv_compile.passes.sites import find_sites, parameter_name
from .errors import LrkvWarning, PlanError, UnrewrittenSiteError
from .fit import check_sites, qualify_names, warn_left_full
from .plan import RankPlan
from .weights import parse
from .trace import PRIVATE_NAME, TRACE_NAME

OPTIONS = {"plan": "RankPlan or path of a saved plan (required)",
           "value_path": "'auto' (by cost), 'absorb' (into the output projection) or 'up' (after the reduction)",
           "kernels": "'auto' (Triton kernels on CUDA where they cover the step, else the reference ops), "
                      "'reference' or 'triton'",
           "inductor": "compile the rewritten graph with Inductor: None (default: on CUDA), True or False",
           "mode": "Inductor's mode for the rewritten graph: 'default', 'reduce-overhead' (CUDA graphs), "
                   "'max-autotune' or 'max-autotune-no-cudagraphs'"}
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_POLICY = {"auto": "auto", "absorb": "always", "up": "never"}
reports = []  # SiteReports of every graph compiled in this process, newest last
graph_runs = 0  # calls of graphs in which this backend rewrote a site: lrkv.compile checks each forward made one
_warned_stock_cache = False


def resolve_options(options) -> tuple[RankPlan, str]:
    """The plan and the value-path policy of the backend's options (the lowering options are `lower`'s)."""
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
    if options.get("kernels", "auto") not in IMPLEMENTATIONS:
        raise PlanError(f"options['kernels']={options['kernels']!r}; choose one of {IMPLEMENTATIONS}")
    if options.get("inductor") not in (None, True, False):
        raise PlanError(f"options['inductor']={options['inductor']!r}; choose None (Inductor on CUDA), True or False")
    mode = options.get("mode", "default")
    if mode not in MODES:
        raise PlanError(f"options['mode']={mode!r}; choose one of {MODES}")
    if mode != "default" and options.get("inductor") is False:
        raise PlanError(f"options['mode']={mode!r} is a mode of Inductor, but options['inductor'] is False")
    return plan, _POLICY[policy]


def _fragment(gm, plan: RankPlan) -> bool:
    """Whether `gm` is a piece of a split forward that holds no attention: it reads none of the plan's K/V weights
    (the model's names may be relative to an inner module's frame, `fit.qualify_names`)."""
    planned = {parse(name)[0] for site in plan.sites for name in (site.k_weight, site.v_weight)}
    names = {parameter_name(node) for node in gm.graph.nodes if node.op == "placeholder"} - {None}
    return not any(full == name or full.endswith("." + name) for full in planned for name in names)


def _counted(forward):
    def run(*args):
        global graph_runs
        graph_runs += 1
        return forward(*args)
    return run


def lrkv_backend(gm, example_inputs, options=None, mode=None, **_):
    """Dynamo backend entry point (registered as 'lrkv' through the torch_dynamo_backends entry point)."""
    global _warned_stock_cache
    options = dict(options or {})
    if mode is not None:  # torch.compile(..., mode=...) without options (it refuses both at once)
        options.setdefault("mode", mode)
    plan, policy = resolve_options(options)
    if not torch._dynamo.config.assume_static_by_default:
        raise UnrewrittenSiteError(
            "torch.compile(..., backend='lrkv', dynamic=True) is not supported: it lifts the model's float and "
            "integer attributes (attention scales, RoPE scaling, layer indices) into graph inputs, which the "
            "rewrite needs as constants. Leave dynamic at its default (None): Dynamo then makes dynamic only the "
            "dimensions that change between calls, such as the sequence length")
    canonicalize(gm)
    sites, unmatched = find_sites(gm)
    if not sites and not unmatched and _fragment(gm, plan):  # e.g. the embedding, before a graph break
        return lower(gm, example_inputs, options.get("kernels", "auto"), options.get("inductor"),
                     options.get("mode", "default"))
    for miss in unmatched:
        warnings.warn(f"lrkv: attention at {miss.node} left untouched: {miss.reason}", LrkvWarning, stacklevel=2)
    qualify_names(plan, sites)
    warn_left_full(check_sites(plan, sites, unmatched, whole_model=False))
    site_reports = rewrite(gm, sites, plan, example_inputs, policy)
    reports.append(site_reports)
    if not _warned_stock_cache and any(r.cache in ("concat", "static") and r.status == "rewritten"
                                     for r in site_reports):
        _warned_stock_cache = True
        warnings.warn("lrkv: the model runs with a stock transformers cache, which stores full keys and values: "
                      "results follow the plan but cache memory is NOT reduced. Pass "
                      "cache=lrkv.LatentCache(model, plan, ...) (past_key_values= before transformers 5.24) to store "
                      "latents.", LrkvWarning, stacklevel=2)
    forward = lower(gm, example_inputs, options.get("kernels", "auto"), options.get("inductor"),
                    options.get("mode", "default"))
    return _counted(forward) if any(r.status == "rewritten" for r in site_reports) else forward


class _FallbackAlarm(logging.Filter):
    """Dynamo reports a frame that hit its recompile limit only in its log, then runs that frame eagerly:
    for a model compiled with lrkv that is the uncompressed model. Say so as a warning, which users see."""

    def filter(self, record):
        lines = record.getMessage().splitlines()
        where = lines[1].strip() if len(lines) > 1 else ""
        if reports and lines[0].startswith("torch._dynamo hit config.") and "recompile_limit" in lines[0] \
                and PRIVATE_NAME not in where and TRACE_NAME not in where:  # lrkv's own copies: no fallback
            warnings.warn(f"lrkv: {lines[0]} ({where}): Dynamo now runs that function WITHOUT compiling it; if it is "
                          "a model's forward compiled with backend='lrkv', that model runs uncompressed. "
                          "lrkv.compile(model, plan) compiles a private copy of the forward (with its own recompile "
                          "budget) and raises instead of falling back", LrkvWarning, stacklevel=2)
        return True


logging.getLogger("torch._dynamo.convert_frame").addFilter(_FallbackAlarm())


def register() -> bool:
    """Register `lrkv_backend` as backend="lrkv" where no installed distribution declares it (the package run from
    a source checkout on PYTHONPATH, without `pip install`), so that string still names it. An installed lrkv
    declares it as a torch_dynamo_backends entry point, which Dynamo loads itself; registering it here too would
    make that load fail on a duplicate name. Returns whether it registered."""
    if "lrkv" in importlib.metadata.entry_points(group="torch_dynamo_backends").names:
        return False
    torch._dynamo.register_backend(lrkv_backend, name="lrkv")
    return True


register()
