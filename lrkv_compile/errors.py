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
    """An attention site the plan covers did not run rewritten: the lrkv backend did not run (Dynamo fell
    back to eager), could not match the site, or a LatentCache was used without the backend."""


class KernelUnavailableError(LrkvError, RuntimeError):
    """kernels='triton' was asked for a step the Triton kernels do not cover (the message says what)."""


class LrkvWarning(UserWarning):
    """Something runs, but not as the plan says everywhere (layers left full, memory not reduced, a
    Dynamo fallback); `warnings.simplefilter("error", lrkv.LrkvWarning)` turns them into errors."""


class SharedLatentsWarning(UserWarning):
    """The GPU decode kernel reads latents that several KV heads share (joint or group schemes, a hybrid plan's joint
    values), each KV head every channel of its block: many times slower than head-wise latents. The results are the
    plan's, so it is not an LrkvWarning; the message names the head-wise fix."""
