"""The backend's last stage: who computes the latent ops, and what compiles the rest of the rewritten graph.

`kernels` ("auto" | "reference" | "triton", `ops.IMPLEMENTATIONS`) is written into every `latent_attention` and
`latent_write` call. With Inductor (the default when the graph runs on CUDA), the rewritten graph is compiled by `compile_fx`, as
backend="inductor" compiles any graph: the matmuls, norms and elementwise work around the latent ops are
fused and tuned, and the latent ops stay opaque calls to their implementations. On CPU the graph runs as
rewritten unless `inductor=True`.
"""
import torch

from . import ahead


def choose_kernels(gm: torch.fx.GraphModule, kernels: str) -> None:
    """Set the implementation of every latent_attention and latent_write call of `gm` to `kernels` (one of
    `ops.IMPLEMENTATIONS`)."""
    for node in gm.graph.nodes:
        if node.target in (torch.ops.lrkv.latent_attention.default, torch.ops.lrkv.latent_write.default):
            node.kwargs = {**node.kwargs, "implementation": kernels}
    gm.recompile()


def lower(gm: torch.fx.GraphModule, example_inputs, kernels: str = "auto", inductor=None, mode: str = "default"):
    """The callable the backend returns for the rewritten `gm`: Inductor's compilation of it in `mode` (as
    torch.compile(mode=...) sets Inductor up: "reduce-overhead" replays CUDA graphs) when `inductor` (None: when
    the graph's tensors are on CUDA, or a mode other than "default" is asked for), else its own forward."""
    choose_kernels(gm, kernels)
    if inductor is None:
        inductor = mode != "default" or any(isinstance(value, torch.Tensor) and value.is_cuda
                                            for value in example_inputs)
    if kernels != "reference":
        _prepare_kernels(gm)
        ahead.start(gm, example_inputs)  # the decode step's Triton kernels compile while Inductor works
    if not inductor:
        return gm.forward
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx
    _name_the_factors(gm)
    return compile_fx(gm, example_inputs, config_patches=list_mode_options(mode))


def _prepare_kernels(gm: torch.fx.GraphModule) -> None:
    """Let the Triton launcher build what it keeps per factor tensor now, at compile time (`triton_decode.prepare`),
    for every latent_attention call whose factors are CUDA buffers of the graph."""
    buffers = dict(gm.named_buffers())

    def constant(node):
        return buffers.get(node.target) if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None
    for node in gm.graph.nodes:
        if node.target is not torch.ops.lrkv.latent_attention.default:
            continue
        up_k, up_v = constant(node.kwargs.get("up_k")), constant(node.kwargs.get("up_v"))
        if up_k is not None and up_k.is_cuda:
            from . import triton_decode  # needs triton, which CPU-only installs may lack
            triton_decode.prepare(up_k, up_v, node.kwargs["num_kv_heads"], node.kwargs.get("rope_window", 0))


def _name_the_factors(gm: torch.fx.GraphModule) -> None:
    """AOTAutograd (Inductor's front end) expects every parameter and buffer of a Dynamo graph to carry the
    source Dynamo lifted it from, and asserts so; the factors the rewrite registered get a source of their own
    (so they are static inputs, as the model's weights are)."""
    from torch._dynamo.source import ConstantSource
    lifted = getattr(gm, "_param_name_to_source", None)
    if lifted is None:
        return
    for name, _ in gm.named_buffers():
        lifted.setdefault(name, ConstantSource(f"lrkv.{name}"))
