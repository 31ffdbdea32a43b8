"""Names of K/V projection weights, including the rows of a fused projection.

A plan names each site's K and V weights. A projection of its own is a parameter name
("model.layers.0.self_attn.k_proj.weight"); one part of a fused q/k/v projection adds the output rows it
takes: "model.layers.0.self_attn.qkv_proj.weight[64:96]" (Phi-3), several ranges for per-head interleaving
"gpt_neox.layers.0.attention.query_key_value.weight[16:32,64:80]" (GPT-NeoX), and ":," for a Conv1D weight
stored [in, out], whose output features are columns: "transformer.h.0.attn.c_attn.weight[:,64:128]" (GPT-2).
"""
import re
from collections.abc import Mapping
from typing import Optional

import torch

_REFERENCE = re.compile(r"^(?P<name>[^\[\]]+)\[(?P<columns>:,)?(?P<ranges>\d+:\d+(?:,\d+:\d+)*)\]$")


def weight_name(parameter: str, rows: Optional[tuple] = None, conv1d: bool = False) -> str:
    """The name of `parameter`'s output features `rows` ((start, stop) ranges; None: all of a [out, in] weight)."""
    if rows is None:
        return parameter
    return f"{parameter}[{':,' if conv1d else ''}{','.join(f'{start}:{stop}' for start, stop in rows)}]"


def parse(name: str) -> tuple[str, Optional[tuple], bool]:
    """(parameter name, output-feature ranges or None, conv1d) of a weight name."""
    found = _REFERENCE.match(name)
    if found is None:
        return name, None, False
    ranges = tuple(tuple(int(bound) for bound in part.split(":")) for part in found["ranges"].split(","))
    return found["name"], ranges, found["columns"] is not None


def row_index(ranges: tuple, device=None) -> torch.Tensor:
    """The output features of `ranges`, in order."""
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in ranges])


class ProjectionWeights(Mapping):
    """A model's parameters by name, where a name may select rows of a fused projection (see the module): each
    value is a projection's weight as [out, in], like an nn.Linear's."""

    def __init__(self, model):
        self.parameters = dict(model.named_parameters())

    def __getitem__(self, name: str) -> torch.Tensor:
        parameter, rows, conv1d = parse(name)
        weight = self.parameters[parameter]
        if conv1d:
            weight = weight.T
        if rows is not None:
            if max(stop for _, stop in rows) > weight.shape[0]:
                raise KeyError(name)
            weight = weight[row_index(rows, weight.device)]
        return weight

    def __contains__(self, name) -> bool:
        try:
            self[name]
        except KeyError:
            return False
        return True

    def __iter__(self):
        return iter(self.parameters)

    def __len__(self) -> int:
        return len(self.parameters)
