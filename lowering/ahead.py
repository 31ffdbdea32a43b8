"""Compiling a graph's Triton kernels while Inductor compiles the rest of it.

Each Triton kernel compiles at its first launch, and a compiled graph's first launch comes only after Inductor has
compiled the graph around the latent ops. For the budget plan with windowed RoPE that put, on a freshly started
H200, about 17 s of one-after-another kernel compiles after Inductor's (the decode kernel alone takes 22.4 s on one
core of this project's CPU machine for sm_90: docs/gpu-notes.md, "Stop 58" and "Stop 59").

`start(gm, example_inputs)`, called by `lower` before Inductor starts, runs the Triton launchers of the graph's
decode-step ops (one call per distinct set of shapes and constants) in worker threads, with `launch.launch`
compiling each kernel (Triton's `warmup`: nothing is launched, no cache is written) instead of launching it. The
arguments are the graph's own tensors where it has them (the cache, the factors) and zero tensors of the traced
shape and layout for the values the graph computes (the projections, the mask), so each kernel compiles for the
specialization its real launch takes. Triton's compiler runs in parallel from threads. The first call of a latent op
waits for them (`settle`, from `ops._dispatch`) and then finds its kernels compiled. A compile that fails here is
left to the real launch, which compiles it again and raises whatever it raises.

Decode steps only (one new token a sequence): a prompt's stand-in tensors would take memory that grows with its
length, and its kernels compile at its first call as before.
"""
import concurrent.futures
import contextlib
import logging
import os
import threading

import torch

_log = logging.getLogger(__name__)
_THREAD = threading.local()  # .compiling: this thread compiles kernels instead of launching them
_PENDING = []  # futures of the work started ahead, not yet waited for
_POOL = None


def compiling() -> bool:
    """Whether this thread compiles kernels ahead (`launch.launch` compiles instead of launching)."""
    return getattr(_THREAD, "compiling", False)


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1),
                                                      thread_name_prefix="lrkv-compile")
    return _POOL


def _submit(work, device: torch.device) -> None:
    """Run work() in a worker that compiles ahead, with `device` current."""
    def run():
        _THREAD.compiling, _THREAD.device = True, device
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), torch.no_grad():
                work()
        except Exception as error:  # the real launch compiles it again and raises what it raises
            _log.debug("lrkv: compiling ahead failed (the first call compiles it instead): %r", error)
        finally:
            _THREAD.compiling = False
    _PENDING.append(_pool().submit(run))


def compile_kernel(kernel, grid, args, constants: dict) -> None:
    """What `launch.launch` does on a thread that compiles ahead: compile `kernel` for these arguments in another
    worker (on this one's device) and return at once."""
    _submit(lambda: kernel.warmup(*args, grid=grid, **constants), _THREAD.device)


def settle() -> None:
    """Wait for every compile started ahead (nothing to wait for: returns at once). On a thread that compiles ahead
    it returns at once: that work is among what would be waited for."""
    if not _PENDING or compiling():  # the common case first: this runs before every kernel launch of an op
        return
    while _PENDING:
        _PENDING.pop().result()  # `_submit`'s work raises nothing; a job's compiles are queued before it ends


def calls(gm: torch.fx.GraphModule, example_inputs) -> list:
    """The decode-step latent op calls of `gm` as (op function, keyword arguments), one per distinct set of argument
    shapes, layouts and constants: the graph's placeholders and attributes as given, every value the graph computes
    as zeros of its traced shape, dtype and strides (found by running the graph up to its last latent op on fake
    tensors). Empty where the graph has none, or where its shapes are not static numbers."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from . import ops

    functions = {torch.ops.lrkv.latent_attention.default: ops.latent_attention,
                 torch.ops.lrkv.latent_write.default: ops.latent_write}
    wanted = [node for node in gm.graph.nodes if node.target in functions]
    if not wanted or any(_symbolic(node.meta.get("example_value")) for node in gm.graph.nodes
                         if node.op == "placeholder"):
        return []  # none, or a graph of symbolic shapes (a prompt's, whose length varies): nothing ahead
    # the graph runs on fake copies of its inputs and attributes (a real input would be written by the graph's
    # in-place ops); the calls take the real ones
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = lambda value: mode.from_tensor(value) if isinstance(value, torch.Tensor) else value  # noqa: E731
    interpreter = torch.fx.Interpreter(gm)
    real, found, seen = {}, [], set()
    placeholders = iter(example_inputs)
    with mode:
        try:
            for node in gm.graph.nodes:  # up to the last of `wanted`, which comes before the output
                if node.op in ("placeholder", "get_attr"):
                    real[node] = next(placeholders) if node.op == "placeholder" else interpreter.fetch_attr(node.target)
                    interpreter.env[node] = fake(real[node])
                    continue
                interpreter.env[node] = interpreter.run_node(node)
                if node.target not in functions:
                    continue
                kwargs = {name: (real[value] if value in real else interpreter.env[value])
                          if isinstance(value, torch.fx.Node) else value for name, value in node.kwargs.items()}
                new = kwargs["query"] if "query" in kwargs else kwargs["new_k"].unsqueeze(1)
                key = (node.target, tuple((name, _describe(value)) for name, value in kwargs.items()
                                          if name not in HOST_ONLY))
                if new.dim() == 4 and new.shape[2] == 1 and key not in seen:  # a prompt's call is not compiled ahead
                    seen.add(key)
                    found.append((functions[node.target], kwargs))
                if node is wanted[-1]:
                    break
        except Exception as error:  # a graph the fake tensors cannot run (data-dependent shapes): nothing ahead
            _log.debug("lrkv: no kernels compiled ahead for this graph: %r", error)
            return []
    return [(function, {name: _zeros(value) if isinstance(value, FakeTensor) else value
                        for name, value in kwargs.items()}) for function, kwargs in found]


HOST_ONLY = {"device_check"}  # arguments of the latent ops that no kernel's compile depends on


def _symbolic(value) -> bool:
    """Whether a placeholder's traced value is a symbolic size or a tensor of symbolic sizes."""
    if isinstance(value, torch.Tensor):
        return any(isinstance(size, torch.SymInt) for size in (*value.shape, *value.stride()))
    return isinstance(value, torch.SymInt)


def _describe(value):
    """What of an argument its kernels' compiles may depend on."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.device, tuple(value.shape), value.stride(), value.storage_offset()
    return value


def _zeros(fake: torch.Tensor) -> torch.Tensor:
    """Zeros of a fake tensor's shape, strides, storage offset and dtype on its device: a view such as the value
    latents split from both sides' product starts as far into its storage as the step's own, so a kernel compiled for
    it assumes the alignment the step's pointer has."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(fake.shape, fake.stride())) if fake.numel() else 0
    storage = torch.zeros(fake.storage_offset() + span, dtype=fake.dtype, device=fake.device)
    return storage.as_strided(fake.shape, fake.stride(), fake.storage_offset())


def start(gm: torch.fx.GraphModule, example_inputs) -> None:
    """Start compiling the Triton kernels of `gm`'s decode-step latent ops (`calls`) in worker threads, where they
    run on CUDA tensors (under Triton's interpreter nothing compiles)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not any(isinstance(value, torch.Tensor) and value.is_cuda
                                                            for value in example_inputs):
        return
    for function, kwargs in calls(gm, example_inputs):
        tensors = [value for value in kwargs.values() if isinstance(value, torch.Tensor)]
        if not tensors or not tensors[0].is_cuda:
            continue
        _submit(lambda function=function, kwargs=kwargs: function(**{**kwargs, "implementation": "triton"}),
                tensors[0].device)
