"""`lrkv.compile(model, plan)`: the strict path in one call (check, compile, cache, never a silent fallback).

    lm = lrkv.compile(model, plan)
    out = lm.generate(ids, max_new_tokens=64)     # a LatentCache sized for the call is made for you
    lm.cache.nbytes()
"""
import inspect

import torch
from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit

from . import backend
from .cache import LatentCache
from .errors import LrkvError, UnrewrittenSiteError
from .fit import check
from .plan import RankPlan
from .rotary import breaks_graph
from .trace import cache_keyword, private_forward

CACHE_ROUNDING = 256  # cache capacities are rounded up to this, so varied lengths reuse compiled graphs


def cache_capacity(tokens: int) -> int:
    """Slots of a cache for `tokens` tokens: rounded up to a multiple of CACHE_ROUNDING."""
    return -(-tokens // CACHE_ROUNDING) * CACHE_ROUNDING


class CompiledModel:
    """`model` with its forward compiled by the lrkv backend under `plan`.

    Calling it (or `.forward`) runs the compiled forward; `.generate` generates through a LatentCache.
    `model` itself is left as it was. Every call checks that the lrkv graph ran: Dynamo running the
    forward eagerly (`torch.compiler.set_stance("force_eager")`, a disabled region) or reaching its
    recompile limit raises UnrewrittenSiteError instead of returning the uncompressed model's answer,
    and lrkv's errors arrive unwrapped from Dynamo's.
    """

    def __init__(self, model, plan: RankPlan, value_path: str = "auto", kernels: str = "auto", inductor=None,
                 mode: str = "default"):
        self.model, self.plan = model, plan
        self.cache = None  # the LatentCache of the last `generate` call that made one
        # one graph, so nothing of the model runs uncompiled; a dynamic-NTK RoPE splits it (`rotary.py`): its
        # decoder layers are a graph of their own, and every call checks that it ran (`forward`)
        self._compiled = torch.compile(private_forward(model), backend="lrkv", fullgraph=not breaks_graph(model),
                                       options={
            "plan": plan, "value_path": value_path, "kernels": kernels, "inductor": inductor, "mode": mode})

    def forward(self, *args, **kwargs):
        before = backend.graph_runs
        ids = kwargs.get("input_ids")
        if ids is not None and ids.dim() == 2 and ids.shape[1] > 1:
            # Prompts of any length share one prefill graph from the first call on (Dynamo would compile the
            # first length alone, then recompile for the rest; one-token decode steps keep their own graph): the
            # ids and what generate() passes beside them along the prompt (its attention mask, positions, cache
            # positions), whose sizes would otherwise pin the ids' length. A slice such as ids[:, :n] has the strides
            # of the whole row, which Dynamo guards on: each is copied.
            for name in ("input_ids", "attention_mask", "position_ids", "cache_position"):
                tensor = kwargs.get(name)
                if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and tensor.shape[-1] > 1:
                    kwargs[name] = tensor = tensor.clone(memory_format=torch.contiguous_format)
                    torch._dynamo.maybe_mark_dynamic(tensor, tensor.dim() - 1)
        try:
            out = self._compiled(*args, **kwargs)
        except BackendCompilerFailed as error:
            if isinstance(error.inner_exception, LrkvError):
                raise error.inner_exception from None
            raise
        except FailOnRecompileLimitHit as error:
            raise UnrewrittenSiteError(
                f"Dynamo reached torch._dynamo.config.recompile_limit={torch._dynamo.config.recompile_limit} for "
                "this compiled model (many different input shapes); raise the limit, or call lrkv.compile again "
                "for a fresh budget") from error
        if backend.graph_runs == before:
            raise UnrewrittenSiteError(
                "the model's forward ran without the lrkv graph of its attention (Dynamo ran it eagerly: "
                "torch.compiler.set_stance('force_eager') or a torch.compiler.disable region), "
                "so the answer would be the uncompressed model's")
        return out

    __call__ = forward

    def generate(self, input_ids, past_key_values=None, **kwargs):
        """`model.generate` through this compiled forward and a LatentCache: the one passed (as `past_key_values`
        or, transformers' newer name, `cache`), or a new one sized for this call (prompt + max_new_tokens, or
        max_length, rounded up to a multiple of 256 slots; rows x num_beams x num_return_sequences), kept as
        `self.cache`."""
        past_key_values = kwargs.pop("cache", past_key_values)
        if past_key_values is None:
            config = kwargs.get("generation_config") or self.model.generation_config
            setting = lambda name: kwargs.get(name, getattr(config, name, None))  # noqa: E731
            if setting("max_new_tokens") is not None:
                needed = input_ids.shape[1] + setting("max_new_tokens")
            elif "max_length" in kwargs:
                needed = kwargs["max_length"]
            else:
                raise ValueError("pass max_new_tokens= (or a LatentCache as past_key_values): the cache is sized "
                                 "for the prompt plus the new tokens")
            rows = input_ids.shape[0] * (setting("num_beams") or 1) * (setting("num_return_sequences") or 1)
            capacity = cache_capacity(needed)
            past_key_values = self.cache = LatentCache(self.model, self.plan, max_batch_size=rows,
                                                       max_cache_len=capacity)
        had_forward = "forward" in self.model.__dict__
        previous = self.model.__dict__.get("forward")

        def forward(*args, **kwargs):
            return self.forward(*args, **kwargs)
        # generate() reads the forward's signature to decide which inputs to prepare (position_ids from the
        # attention mask, for example), so this one shows the model's
        forward.__signature__ = inspect.signature(self.model.forward)
        self.model.forward = forward  # generate() calls model.forward; set only for this call
        try:
            return self.model.generate(input_ids, **{cache_keyword(self.model): past_key_values}, **kwargs)
        finally:
            if had_forward:
                self.model.forward = previous
            else:
                del self.model.forward


def compile(model, plan, value_path: str = "auto", kernels: str = "auto", inductor=None,
            mode: str = "default") -> CompiledModel:
    """Check `plan` against `model` (lrkv's errors, raised directly), then compile the model's forward with
    the lrkv backend and fullgraph=True. `plan` is a RankPlan or the path of a saved one; the other
    arguments are the backend's options of the same names (`lrkv_compile.backend.OPTIONS`)."""
    plan, _ = backend.resolve_options({"plan": plan, "value_path": value_path, "kernels": kernels,
                                       "inductor": inductor, "mode": mode})
    check(model, plan)
    return CompiledModel(model, plan, value_path, kernels, inductor, mode)
