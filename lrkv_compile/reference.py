"""The eager low-rank reference: the model with each planned K/V projection replaced by its two factors."""
import copy
from contextlib import contextmanager

import torch
from torch import nn

from lrkv_compile.lowering.quantize import exact_dtype, fake_quantize

from .errors import PlanMismatchError
from .fit import check_parameters
from .plan import Layout, RankPlan


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


def low_rank_reference(model, plan: RankPlan):
    """A copy of `model` whose planned K/V projections are replaced by the plan's factors (eager, no cache tricks)."""
    check_parameters(plan, model)
    reference = copy.deepcopy(model)
    reference.__dict__.pop("forward", None)  # a compiled forward set on the instance would still run `model`
    modules = dict(reference.named_modules())
    for site in plan.sites:
        for weight_name, down, up, layout in ((site.k_weight, site.down_k, site.up_k, site.k_layout),
                                              (site.v_weight, site.down_v, site.up_v, site.v_layout)):
            module_name = weight_name.rsplit(".", 1)[0]
            linear = modules[module_name]
            if not isinstance(linear, nn.Linear):
                raise PlanMismatchError(f"{weight_name} belongs to a {type(linear).__name__}, not an nn.Linear; "
                                        "the eager reference replaces linear projections only")
            factored = FactoredLinear(down, up, linear.bias, layout).to(linear.weight.device, linear.weight.dtype)
            reference.set_submodule(module_name, factored)
    return reference
