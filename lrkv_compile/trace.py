"""Capture the Dynamo FX graph of a model's forward (the graph the lrkv backend will see) without leaving
compiled state behind.

Dynamo keeps its compiled entries, and counts recompiles against `recompile_limit`, per code object.
transformers wraps every model's `forward` in decorators whose code object is shared by all models, so
compiling `model.forward` for a trace would spend the user's recompile budget: after a few calibrations
their own `torch.compile(model.forward, backend="lrkv")` would silently run eager. Every trace here (and
`lrkv.compile`) therefore compiles a private copy of the forward's code; its entries die with the copy.

Traces and compiled models get copies of different names: Dynamo's automatic dynamic shapes (and its profile of
them) remember the sizes each function was compiled at by file, line and name, so a trace at a calibration
batch would make the compiled model's first graph dynamic in its batch and cache sizes (symbolic shapes: a
compile twice as long on a 32-layer model, and no gain for a cache whose sizes are fixed).
"""
import inspect
import types

import torch
import transformers
from torch._dynamo.exc import Unsupported, UserError

from lrkv_compile.passes.canonicalize import canonicalize
from .errors import UnrewrittenSiteError
from .rotary import one_graph

PRIVATE_NAME = "lrkv_private_forward"  # the code names Dynamo's messages show for these copies: compiled models
TRACE_NAME = "lrkv_trace_forward"      # and traces


def private_forward(model, name: str = PRIVATE_NAME):
    """`type(model).forward` bound to `model`, with a code object of its own named `name` (see the module
    docstring).

    The class's forward is used, so an instance-level `model.forward = torch.compile(...)` is looked through.
    """
    function = type(model).forward
    copy = types.FunctionType(function.__code__.replace(co_name=name), function.__globals__,
                              function.__name__, function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)  # functools.wraps' __wrapped__, which the wrapper's body reads
    return types.MethodType(copy, model)


_CACHE_KEYWORDS = {}  # model class -> the keyword its forward takes the cache by


def cache_keyword(model) -> str:
    """The keyword the model's forward and generate() take the cache by, read once per class from the forward's
    signature: `cache` from transformers 5.24 (which deprecates `past_key_values`), `past_key_values` before."""
    cls = type(model)
    if cls not in _CACHE_KEYWORDS:
        _CACHE_KEYWORDS[cls] = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    return _CACHE_KEYWORDS[cls]


def _untraceable(model, error) -> str:
    reason = str(error).strip().splitlines()[0]
    return (f"Dynamo cannot capture {type(model).__name__}.forward as one graph ({reason}), so lrkv cannot find or "
            f"rewrite its attention. Where the model's own code branches on a tensor's value, a newer transformers "
            f"may trace (this is {transformers.__version__}; OPT and models without RoPE trace from 5.20, dynamic-NTK "
            f"and longrope RoPE from 5.21: README, 'Two commands')")


class _Captured(Exception):
    """Raised by the capturing graph instead of running it: a trace needs the graph, not its outputs."""


def capture(model, input_ids: torch.Tensor, cache=None):
    """Trace `model.forward(input_ids=...)` with Dynamo, through `cache` if given (else with
    use_cache=False), and canonicalize it; the graph is captured, never run, and no compiled state outlives the
    call. A dynamic-NTK rotary embedding is traced with its frequencies set for this call (`rotary.one_graph`).

    Returns (graph module, example inputs, index of input_ids among them, name_of) where name_of maps a
    placeholder to its parameter name.
    """
    captured = []

    def keep_graph(gm, example_inputs, **_):
        captured.append((gm, list(example_inputs)))

        def stop(*args):
            raise _Captured()
        return stop

    compiled = torch.compile(private_forward(model, TRACE_NAME), backend=keep_graph, fullgraph=True,
                             dynamic=False)
    cache_kwargs = {cache_keyword(model): cache, "use_cache": True} if cache is not None else {"use_cache": False}
    start = int(cache.get_seq_length()) if cache is not None else 0
    positions = torch.arange(start, start + input_ids.shape[1])[None]
    try:
        with torch.no_grad(), one_graph(model, positions):
            compiled(input_ids=input_ids, **cache_kwargs)
    except _Captured:
        pass
    except (Unsupported, UserError) as error:
        raise UnrewrittenSiteError(_untraceable(model, error)) from error
    if len(captured) != 1:
        raise RuntimeError(f"expected one graph from the model's forward, Dynamo produced {len(captured)}")
    gm, example_inputs = captured[0]
    canonicalize(gm)  # the graph the backend will rewrite is canonicalized the same way
    names = {id(tensor): name for name, tensor in list(model.named_parameters()) + list(model.named_buffers())}
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    by_node = {node: names.get(id(value)) for node, value in zip(placeholders, example_inputs)}
    ids_index = next(i for i, value in enumerate(example_inputs) if value is input_ids)
    return gm, example_inputs, ids_index, by_node.get
