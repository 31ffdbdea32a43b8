"""Rotary embeddings whose frequencies transformers recomputes while the model runs.

transformers decorates every rotary embedding's forward with `dynamic_rope_update`. For most RoPE types it does
nothing, and the frequencies (`inv_freq`) are fixed: a LatentCache stores each token's position and rebuilds its
RoPE from them. For two types it recomputes `inv_freq` from the longest position of the call before computing
cos/sin: "dynamic" (NTK scaling, which grows the base with the sequence) and "longrope" (short or long factors
either side of the pretraining length). A stock cache keeps each key rotated with the frequencies of the step that
wrote it, so a LatentCache of such a model stores each token's cos/sin rows (`rope_rows`), not only its position.
Dynamic NTK also decides in Python, from a tensor, whether to recompute: Dynamo breaks the graph there, and the
decoder layers get cos/sin as inputs of a graph of their own.
"""
import inspect
from contextlib import contextmanager
from types import MethodType

import torch
from transformers.modeling_rope_utils import dynamic_rope_update

_UPDATED = dynamic_rope_update(lambda self, x, position_ids: None).__code__  # the decorator's wrapper


def _rope_types(module) -> list:
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, dict):  # one per layer type (Gemma 3)
        return list(rope_type.values())
    return [rope_type] if isinstance(rope_type, str) else []


def _is_update(function) -> bool:
    return getattr(function, "__code__", None) is _UPDATED


def _update_wrapper(function):
    """The `dynamic_rope_update` wrapper in `function`'s chain of decorators (inspect.unwrap's `__wrapped__` chain:
    some models put `torch.no_grad()` outside it, Phi-3 on transformers 5.21-5.23), or None."""
    if function is None:
        return None
    found = inspect.unwrap(function, stop=_is_update)
    return found if _is_update(found) else None


def recomputes(module) -> bool:
    """Whether `module` is a rotary embedding whose forward recomputes its frequencies on each call (the
    conditions of transformers' `dynamic_rope_update`)."""
    return (_update_wrapper(getattr(type(module), "forward", None)) is not None
            and any("dynamic" in kind or kind == "longrope" for kind in _rope_types(module)))


def rows_width(model) -> int:
    """The rotary dimension of the model's recomputing rotary embedding, whose cos/sin rows a LatentCache stores per
    token (0: none recomputes, positions are enough)."""
    widths = {2 * module.inv_freq.numel() for module in model.modules() if recomputes(module)}
    if len(widths) > 1 or any(len(_rope_types(module)) > 1 for module in model.modules() if recomputes(module)):
        raise NotImplementedError("lrkv stores one width of RoPE rows per cache; this model recomputes RoPE "
                                  "frequencies in several rotary embeddings or per layer type")
    return widths.pop() if widths else 0


def _dynamic(model) -> list:
    return [module for module in model.modules()
            if recomputes(module) and any("dynamic" in kind for kind in _rope_types(module))]


def breaks_graph(model) -> bool:
    """Whether Dynamo splits the model's forward at a dynamic-NTK rotary embedding's decision to recompute."""
    return bool(_dynamic(model))


@contextmanager
def one_graph(model, positions: torch.Tensor):
    """Let Dynamo capture the model as one graph although its RoPE is dynamic NTK: each such rotary embedding
    first runs eagerly on `positions` (the call's position ids), which recomputes its frequencies as the model's
    forward would for this call, then is traced without its update, over the frequencies just set. The graph
    computes what the model computes for this call; it is for analysis (calibration, explain, checks), not for
    running other calls."""
    dynamic = _dynamic(model)
    reference = next(model.parameters())
    for module in dynamic:
        with torch.no_grad():
            module(torch.zeros(1, dtype=reference.dtype, device=reference.device), positions.to(reference.device))
        module.forward = MethodType(_update_wrapper(type(module).forward).__wrapped__, module)
    try:
        yield
    finally:
        for module in dynamic:
            del module.forward
