"""The custom ops the rewritten graph calls. Each has a schema, a fake (shape) implementation for
tracing, and an implementation chosen here; today every implementation is the PyTorch reference in
`lowering.reference` (the Triton kernels come later and plug in at `_impl`).
"""
from typing import Optional

import torch
from torch import Tensor

from lrkv_compile.errors import UnrewrittenSiteError
from . import reference


@torch.library.custom_op("lrkv::cache_marker", mutates_args=())
def cache_marker(key_states: Tensor, value_states: Tensor, latent_k: Tensor, latent_v: Tensor,
                 rope_cos: Tensor, rope_sin: Tensor, length: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
    """Stands where a cache update returns full keys/values; the lrkv backend replaces it by latent ops."""
    raise UnrewrittenSiteError(
        f"layer {layer_idx}: a LatentCache holds latents, not keys and values, so the attention site must be "
        "rewritten by the lrkv backend. Compile the model with torch.compile(model.forward, backend='lrkv', "
        "options={'plan': plan}); if you did, lrkv.explain(model) shows why this site did not match."
    )


@cache_marker.register_fake
def _(key_states, value_states, latent_k, latent_v, rope_cos, rope_sin, length, layer_idx):
    batch, kv_heads, _, head_dim = key_states.shape
    slots = latent_k.shape[1]
    return (key_states.new_empty(batch, kv_heads, slots, head_dim),
            value_states.new_empty(batch, value_states.shape[1], slots, value_states.shape[-1]))


@torch.library.custom_op("lrkv::latent_write", mutates_args=("latent_k", "latent_v", "rope_cos", "rope_sin"))
def latent_write(latent_k: Tensor, latent_v: Tensor, rope_cos: Tensor, rope_sin: Tensor, new_k: Tensor,
                 new_v: Tensor, cos: Optional[Tensor], sin: Optional[Tensor], length: Tensor) -> None:
    """Store this step's K/V latents (and their RoPE rows) in the cache buffers, in place."""
    reference.latent_write(latent_k, latent_v, rope_cos, rope_sin, new_k, new_v, cos, sin, length)


@latent_write.register_fake
def _(latent_k, latent_v, rope_cos, rope_sin, new_k, new_v, cos, sin, length):
    return None


@torch.library.custom_op("lrkv::latent_attention", mutates_args=())
def latent_attention(query: Tensor, latent_k: Tensor, latent_v: Tensor, rope_cos: Tensor, rope_sin: Tensor,
                     up_k: Tensor, bias_k: Optional[Tensor], up_v: Optional[Tensor], bias_v: Optional[Tensor],
                     length: Tensor, attn_mask: Optional[Tensor], scale: float, num_kv_heads: int) -> Tensor:
    """Attention over the latent cache; see `reference.latent_attention` for the contract."""
    return reference.latent_attention(query, latent_k, latent_v, rope_cos, rope_sin, up_k, bias_k, up_v, bias_v,
                                      length, attn_mask, scale, num_kv_heads)


@latent_attention.register_fake
def _(query, latent_k, latent_v, rope_cos, rope_sin, up_k, bias_k, up_v, bias_v, length, attn_mask, scale,
      num_kv_heads):
    batch, heads, tokens, head_dim = query.shape
    if up_v is None:
        return query.new_empty(batch, tokens, heads * latent_v.shape[-1])
    return query.new_empty(batch, heads, tokens, head_dim)
