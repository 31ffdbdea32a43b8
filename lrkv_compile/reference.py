"""The eager low-rank reference: the model with each planned K/V projection replaced by its two factors."""
import copy
from contextlib import contextmanager

import torch
from torch import nn

from lrkv_compile.lowering.quantize import exact_dtype, fake_quantize

from .errors import PlanMismatchError
from .fit import check_parameters
from .plan import Layout, RankPlan
from .weights import parse, row_index


class FactoredLinear(nn.Module):
    """y = q(x down) up + bias: a low-rank stand-in for an nn.Linear, q the layout's quantize-dequantize of
    the latents (identity at 16 bits), so the numbers are those of a trip through a quantized cache.

    Outside `stepwise` every token is quantized (a stock cache stores the quantized keys and values and
    attends over them); inside it, `history` holds the quantized latents of the positions earlier steps wrote
    and `exact` their 16-bit latents, read where a LatentCache holds them exact (the layout's sinks and window).
    """

    def __init__(self, down: torch.Tensor, up: torch.Tensor, bias, layout: Layout):
        super().__init__()
        self.layout = layout
        self.stepping, self.history, self.exact = False, None, None
        self.down = nn.Linear(down.shape[0], down.shape[1], bias=False)
        self.up = nn.Linear(up.shape[0], up.shape[1], bias=bias is not None)
        with torch.no_grad():
            self.down.weight.copy_(down.T)
            self.up.weight.copy_(up.T)
            if bias is not None:
                self.up.bias.copy_(bias)

    def forward(self, x):
        latent = self.down(x)
        layout = self.layout
        if not self.stepping:
            return self.up(fake_quantize(latent, layout.bits, layout.group, layout.axis, layout.outliers))
        seen = 0 if self.history is None else self.history.shape[1]
        fresh = latent[:, seen:]
        exact = fresh if layout.bits == 16 else fresh.to(exact_dtype(fresh.dtype)).to(fresh.dtype)
        self.exact = exact if self.exact is None else torch.cat((self.exact, exact), dim=1)
        if layout.axis == "token":
            quantized = fake_quantize(fresh, layout.bits, layout.group, outliers=layout.outliers)
            self.history = quantized if self.history is None else torch.cat((self.history, quantized), dim=1)
        else:  # the blocks this step completes, quantized from their 16-bit copies; an open block reads exact
            first, end = seen - seen % layout.group, latent.shape[1] // layout.group * layout.group
            blocks = fake_quantize(self.exact[:, first:end], layout.bits, layout.group, layout.axis, layout.outliers)
            self.history = torch.cat((self.exact[:, :0] if self.history is None else self.history[:, :first], blocks,
                                      self.exact[:, max(first, end):]), dim=1)
        slots = torch.arange(latent.shape[1], device=latent.device)[None, :, None]
        held_exact = (slots < layout.sinks) | (slots >= latent.shape[1] - layout.window)
        earlier = torch.where(held_exact, self.exact, self.history)[:, :seen]
        return self.up(torch.cat((earlier, fresh), dim=1))


@contextmanager
def stepwise(reference):
    """Within the block, each full forward of `reference` (from `low_rank_reference`) over the sequence so
    far is one step of a LatentCache: positions seen by earlier forwards use the latents recorded at their
    own step, quantized (as the cache stores them) or in 16 bits where the cache holds them exact (the
    layout's sinks and most recent `window` positions); the new positions use their exact latents (as the
    cache's attention does for the current step) and are recorded. A position's output depends on earlier
    positions only through their keys and values, so its logits are those of the cached run."""
    modules = [m for m in reference.modules() if isinstance(m, FactoredLinear)]
    for module in modules:
        module.stepping, module.history, module.exact = True, None, None
    try:
        yield reference
    finally:
        for module in modules:
            module.stepping, module.history, module.exact = False, None, None


class FusedProjection(nn.Module):
    """A fused q/k/v projection (an nn.Linear, or a Conv1D stored [in, out]) whose planned output features (K's,
    V's) come from their FactoredLinears; the others (the queries') are the module's own."""

    def __init__(self, module: nn.Module, parts: dict):
        super().__init__()
        self.module = module
        self.parts = nn.ModuleList(parts.values())
        for position, rows in enumerate(parts):
            self.register_buffer(f"rows{position}", row_index(rows), persistent=False)

    def forward(self, x):
        y = self.module(x)
        for position, part in enumerate(self.parts):
            y = y.index_copy(-1, getattr(self, f"rows{position}"), part(x))
        return y


def low_rank_reference(model, plan: RankPlan):
    """A copy of `model` whose planned K/V projections are replaced by the plan's factors (eager, no cache tricks).
    The model's own attention computes exact RoPE: a plan with windowed RoPE (`RankPlan.rope_window`) is an error
    here, not a reference that answers for another plan."""
    check_parameters(plan, model)
    if plan.rope_window:
        raise PlanMismatchError(f"the eager low-rank reference runs the model's own attention, which computes exact "
                                f"RoPE, and this plan has rope_window={plan.rope_window}: compare with "
                                "dataclasses.replace(plan, rope_window=0), or run the plan with lrkv.compile and a "
                                "LatentCache")
    reference = copy.deepcopy(model)
    reference.__dict__.pop("forward", None)  # a compiled forward set on the instance would still run `model`
    modules = dict(reference.named_modules())
    fused = {}  # module name -> {rows: FactoredLinear}
    for site in plan.sites:
        for name, down, up, layout in ((site.k_weight, site.down_k, site.up_k, site.k_layout),
                                       (site.v_weight, site.down_v, site.up_v, site.v_layout)):
            parameter, rows, conv1d = parse(name)
            module_name = parameter.rsplit(".", 1)[0]
            module = modules[module_name]
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or (
                    rows is None and not isinstance(module, nn.Linear)):
                raise PlanMismatchError(f"{name} belongs to a {type(module).__name__}; the eager reference replaces "
                                        "linear (or Conv1D) projections only")
            bias = None if module.bias is None else module.bias[row_index(rows, weight.device)] if rows else module.bias
            factored = FactoredLinear(down, up, bias, layout).to(weight.device, weight.dtype)
            if rows is None:
                reference.set_submodule(module_name, factored)
            else:
                fused.setdefault(module_name, {})[rows] = factored
    for module_name, parts in fused.items():
        reference.set_submodule(module_name, FusedProjection(modules[module_name], parts))
    return reference
