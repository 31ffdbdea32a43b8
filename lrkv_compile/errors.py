"""Every error lrkv raises on purpose. Each message names the offending input and the fix."""


class LrkvError(Exception):
    """Base class of lrkv's own errors."""


class PlanError(LrkvError, ValueError):
    """A rank plan is malformed: a field is missing, has the wrong type, or is out of range."""


class CorruptPlanError(PlanError):
    """A plan file cannot be read back (truncated, not a plan, or from an unknown schema)."""


class PlanMismatchError(PlanError):
    """A plan does not fit the model it is applied to (names or shapes differ)."""


class CacheOverflowError(LrkvError, RuntimeError):
    """The context grew past the capacity a LatentCache was created with."""


class UnrewrittenSiteError(LrkvError, RuntimeError):
    """A LatentCache was used by an attention site the lrkv backend did not rewrite."""
