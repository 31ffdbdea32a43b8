"""lrkv: a torch.compile backend that caches low-rank latents instead of full keys and values.

    plan = lrkv.calibrate(model, batches, keep=0.5)
    lm = lrkv.compile(model, plan)                   # checks, compiles, raises rather than falls back
    lm.generate(ids, max_new_tokens=64)               # through a LatentCache (lm.cache)
"""
from .errors import (CacheOverflowError, CorruptPlanError, KernelUnavailableError, LrkvError, LrkvWarning, PlanError,
                     PlanMismatchError, SharedLatentsWarning, UnrewrittenSiteError)
from .plan import Layout, RankPlan, SitePlan
from .calibrate import calibrate, collect_stats
from .cache import LatentCache
from .backend import lrkv_backend
from .fit import check
from .compiled import CompiledModel, compile
from .reference import low_rank_reference
from .report import explain
from .trace import cache_keyword
from .transfer import transfer

__all__ = ["RankPlan", "SitePlan", "Layout", "calibrate", "collect_stats", "LatentCache", "lrkv_backend", "check", "compile", "CompiledModel",
           "cache_keyword", "low_rank_reference", "explain", "transfer", "LrkvError", "LrkvWarning", "PlanError", "CorruptPlanError",
           "PlanMismatchError", "CacheOverflowError", "UnrewrittenSiteError", "KernelUnavailableError",
           "SharedLatentsWarning"]
