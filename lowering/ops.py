"""The custom ops the rewritten graph calls. Each has a schema (its Python signature, declared once here
and called by keyword everywhere), a fake (shape) implementation for tracing that names only the arguments it
reads (`_fake` binds the rest by that signature), and an implementation;
the PyTorch reference in `lowering.reference` computes each one, and `latent_attention` runs on the Triton
decode kernel (`lowering.triton_decode`, one new token) or prefill kernel (`lowering.triton_prefill`, several),
and `latent_write` on the Triton write (`lowering.triton_write`), where their `implementation` argument says so.

Each side's cache state is four tensors: latents (model dtype, or packed uint8 codes), fp16 scale and
fp16 zero point (empty for 16-bit sides), and `exact` (the sink and recent-window tokens' latents in 16
bits; empty when the layout keeps none). One `positions` buffer (int32 [max_batch, slots]) holds every
slot's RoPE position, and one `rope_rows` buffer ([max_batch, slots, 2, rotary_dim], empty unless the model
recomputes its RoPE frequencies as it runs: `lrkv_compile/rotary.py`) every slot's cos and sin rows.
`lowering/quantize.py` documents the byte layout.
"""
import inspect
from typing import Optional

import torch
from torch import Tensor

from lrkv_compile.errors import KernelUnavailableError, UnrewrittenSiteError
from . import ahead, quantize, reference

# who computes latent_attention: "auto" the Triton kernel on CUDA tensors where it covers the step (decode), else
# the reference; "reference" always the PyTorch reference (the oracle); "triton" the kernel or an error saying why
# not (on CPU it needs TRITON_INTERPRET=1)
IMPLEMENTATIONS = ("auto", "reference", "triton")


def _dispatch(implementation: str, on_cuda: bool, kernel, reference_op):
    """Who computes an op: `kernel()` (a Triton launcher) where `implementation` asks for it ("triton", or "auto" on
    CUDA tensors), else `reference_op()`; under "auto" a kernel's NotImplementedError falls back to the reference,
    under "triton" it is a KernelUnavailableError saying why."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; choose one of {IMPLEMENTATIONS}")
    if implementation == "triton" or implementation == "auto" and on_cuda:
        ahead.settle()  # the kernels compiling ahead, if any (`lowering.ahead`)
        try:
            return kernel()
        except NotImplementedError as why:
            if implementation == "triton":
                raise KernelUnavailableError(f"lrkv kernels='triton': {why}; use kernels='auto' to run the "
                                             "reference op where the kernel does not apply") from None
    return reference_op()


# the library the hot ops are defined in (`_direct_op`); custom_op keeps fragments of its own in the same namespace
_LIBRARY = torch.library.Library("lrkv", "FRAGMENT")


def _direct_op(mutates_args=()):
    """Define the decorated function as the op lrkv::<its name>, with the schema its signature declares and itself
    as the implementation on every device, through the low-level torch.library API (as vLLM registers its hot
    ops). The ops called once per layer and decode step take this path: custom_op's Python layers around each call
    (autograd, version bumps over an argument walk quadratic in the count of arguments, alias checks) cost ~0.1-0.2
    ms a call on a GPU host, and the default mode pays that per layer and step. These ops have no autograd formula
    (the model decodes under no_grad): with grad enabled their outputs carry PyTorch's fallback, which warns when
    backpropagated through (and at compile time), where a custom_op raised. Returns the function itself, whose
    direct calls run its body without the dispatcher: call the op as torch.ops.lrkv.<name>, as the rewrite does."""
    def decorator(fn):
        _LIBRARY.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIBRARY.impl(fn.__name__, fn, "CompositeExplicitAutograd")
        fn._lrkv_op = f"lrkv::{fn.__name__}"
        return fn
    return decorator


def _fake(op):
    """Register the decorated function as `op`'s fake (a custom_op definition, or a `_direct_op` function), called
    with the op's arguments bound by name to the op's own signature (defaults applied), so the fake names only the
    arguments it reads (and **_ for the rest)."""
    declaration = getattr(op, "_init_fn", op)  # the function that declared the op
    signature = inspect.signature(declaration)

    def decorator(fn):
        def fake(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return fn(**bound.arguments)

        if hasattr(declaration, "_lrkv_op"):
            torch.library.register_fake(declaration._lrkv_op, fake, lib=_LIBRARY)
        else:
            op.register_fake(fake)
        return fn

    return decorator


@torch.library.custom_op("lrkv::cache_marker", mutates_args=())
def cache_marker(key_states: Tensor, value_states: Tensor, latent_k: Tensor, k_scale: Tensor, k_zero: Tensor,
                 k_exact: Tensor, latent_v: Tensor, v_scale: Tensor, v_zero: Tensor, v_exact: Tensor,
                 positions: Tensor, rope_rows: Tensor, length: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
    """Stands where a cache update returns full keys/values; the lrkv backend replaces it by latent ops."""
    raise UnrewrittenSiteError(
        f"layer {layer_idx}: a LatentCache holds latents, not keys and values, so the attention site must be "
        "rewritten by the lrkv backend. Compile the model with torch.compile(model.forward, backend='lrkv', "
        "options={'plan': plan}) or lrkv.compile(model, plan); if you did, lrkv.explain(model, plan) shows why "
        "this site did not match."
    )


@_fake(cache_marker)
def _(key_states, value_states, positions, **_):
    batch, kv_heads, _, head_dim = key_states.shape
    slots = positions.shape[1]  # the context (a sliding-window layer's latents may be a shorter ring)
    return (key_states.new_empty(batch, kv_heads, slots, head_dim),
            value_states.new_empty(batch, value_states.shape[1], slots, value_states.shape[-1]))


@_direct_op(mutates_args=("latent_k", "k_scale", "k_zero", "k_exact", "latent_v", "v_scale", "v_zero", "v_exact",
                          "positions", "rope_rows"))
def latent_write(latent_k: Tensor, k_scale: Tensor, k_zero: Tensor, k_exact: Tensor, latent_v: Tensor,
                 v_scale: Tensor, v_zero: Tensor, v_exact: Tensor, positions: Tensor, new_k: Tensor, new_v: Tensor,
                 new_positions: Optional[Tensor], length: Tensor, k_bits: int, k_group: int, k_sinks: int,
                 k_axis: str, k_outliers: int, v_bits: int, v_group: int, v_sinks: int, v_axis: str,
                 v_outliers: int, rope_rows: Tensor, new_cos: Optional[Tensor], new_sin: Optional[Tensor],
                 device_check: bool = True, implementation: str = "auto") -> None:
    """Store this step's K/V latents (quantized per the layout, exact copies of sinks and window) and their
    positions (or RoPE rows) in the cache, in place. `device_check`: whether a context longer than the cache stops
    the GPU here (a device assertion; on the CPU the host always raises CacheOverflowError). The rewrite sets it on
    one write a graph (`_Rewriter.check_once`): every layer's write of a step has the same length and capacity, and
    the others store nothing past the cache (the Triton write checks, the reference's indexing refuses).
    `implementation` (`IMPLEMENTATIONS`): "auto" the Triton write (`lowering.triton_write`, one launch) on CUDA
    tensors where it covers the layout, else the reference."""
    arguments = dict(locals())  # the op's own arguments, by name
    del arguments["implementation"]

    def kernel():
        from . import triton_write  # needs triton, which CPU-only installs may lack
        triton_write.latent_write(**arguments)
    _dispatch(implementation, new_k.is_cuda, kernel, lambda: reference.latent_write(**arguments))


@_fake(latent_write)
def _(**_):
    return None  # it only writes the cache, in place


@_direct_op()
def latent_attention(query: Tensor, latent_k: Tensor, k_scale: Tensor, k_zero: Tensor, k_exact: Tensor,
                     latent_v: Tensor, v_scale: Tensor, v_zero: Tensor, v_exact: Tensor, positions: Tensor,
                     new_k: Tensor, new_v: Tensor, up_k: Tensor, bias_k: Optional[Tensor], up_v: Optional[Tensor],
                     bias_v: Optional[Tensor], inv_freq: Optional[Tensor], rope_scale: float, length: Tensor,
                     attn_mask: Optional[Tensor], softmax_scale: float, num_kv_heads: int, k_bits: int,
                     k_group: int, k_sinks: int, k_axis: str, k_outliers: int, v_bits: int, v_group: int,
                     v_sinks: int, v_axis: str, v_outliers: int, k_norm_weight: Optional[Tensor] = None,
                     k_norm_offset: float = 0.0, k_norm_eps: float = 0.0, softcap: float = 0.0,
                     new_positions: Optional[Tensor] = None, rope_cos: Optional[Tensor] = None,
                     rope_sin: Optional[Tensor] = None, rope_rows: Optional[Tensor] = None,
                     new_cos: Optional[Tensor] = None, new_sin: Optional[Tensor] = None, rope_window: int = 0,
                     implementation: str = "auto") -> Tensor:
    """Attention over the latent cache; see `reference.latent_attention` for the contract. `implementation`
    (`IMPLEMENTATIONS`) picks the code that computes it."""
    arguments = dict(locals())  # the op's own arguments, by name
    del arguments["implementation"]

    def kernel():
        from . import triton_decode, triton_prefill  # need triton, which CPU-only installs may lack
        if k_norm_weight is not None:
            raise NotImplementedError("the decode kernel does not apply a per-head key norm (q/k norm models)")
        if inv_freq is not None and 2 * inv_freq.shape[-1] != query.shape[-1]:
            raise NotImplementedError("the decode kernel applies RoPE to every channel, not partial rotary")
        if rope_cos is not None:
            raise NotImplementedError("the decode kernel computes RoPE from inv_freq, not from the model's cos/sin "
                                      "tables")
        if rope_rows is not None:
            raise NotImplementedError("the decode kernel computes RoPE from inv_freq, not from cos/sin rows stored "
                                      "per token (a model that recomputes its RoPE frequencies as it runs)")
        if softcap:
            raise NotImplementedError("the decode kernel does not soft-cap attention scores")
        if latent_k.shape[1] < positions.shape[1]:
            raise NotImplementedError("the decode kernel reads a full-length cache, not a sliding-window ring")
        kernel_arguments = {name: value for name, value in arguments.items()
                            if not name.startswith("k_norm_")
                            and name not in ("softcap", "new_positions", "rope_cos", "rope_sin", "rope_rows",
                                             "new_cos", "new_sin")}
        launch = triton_decode.decode_attention if query.shape[2] == 1 else triton_prefill.prefill_attention
        return launch(**kernel_arguments)
    return _dispatch(implementation, query.is_cuda, kernel, lambda: reference.latent_attention(**arguments))


@_fake(latent_attention)
def _(query, new_v, up_v, **_):
    batch, heads, tokens, head_dim = query.shape
    if up_v is None:
        return query.new_empty(batch, tokens, heads * new_v.shape[-1])
    return query.new_empty(batch, heads, tokens, head_dim)


@torch.library.custom_op("lrkv::fake_quantize", mutates_args=())
def fake_quantize(latent: Tensor, bits: int, group: int, axis: str, outliers: int) -> Tensor:
    """The latent as it reads back from a quantized cache (the stock-cache path's numbers)."""
    return quantize.fake_quantize(latent, bits, group, axis, outliers).clone()


@_fake(fake_quantize)
def _(latent, **_):
    return torch.empty_like(latent)
