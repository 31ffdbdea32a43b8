"""lrkv: a torch.compile backend that caches low-rank latents instead of full keys and values.

    plan = lrkv.calibrate(model, batches, keep=0.5)
    model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
    cache = lrkv.LatentCache(model, plan, max_batch_size=1, max_cache_len=2048)
    model.generate(ids, past_key_values=cache, max_new_tokens=64)
"""
import os as _os

# Installed, passes/ lowering/ kernels/ live inside this package (pyproject maps them). Imported straight
# from a source checkout (repo root on sys.path), they are siblings of this folder: look there too.
_here = _os.path.dirname(__file__)
if not _os.path.isdir(_os.path.join(_here, "passes")):
    __path__.append(_os.path.dirname(_here))

from .errors import (CacheOverflowError, CorruptPlanError, LrkvError, PlanError, PlanMismatchError,
                     UnrewrittenSiteError)
from .plan import RankPlan, SitePlan
from .calibrate import calibrate
from .cache import LatentCache
from .backend import lrkv_backend
from .reference import low_rank_reference
from .report import explain

__all__ = ["RankPlan", "SitePlan", "calibrate", "LatentCache", "lrkv_backend", "low_rank_reference", "explain",
           "LrkvError", "PlanError", "CorruptPlanError", "PlanMismatchError", "CacheOverflowError",
           "UnrewrittenSiteError"]
