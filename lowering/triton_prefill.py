"""Triton lowering of `latent_attention` for prefill and chunked prefill (any number of new tokens per sequence):
input checks, launch grid, strides, and the value up-projection after the kernel.

`prefill_attention(**kwargs)` takes the keyword arguments `triton_decode.decode_attention` takes (those of
`reference.latent_attention` that `ops.latent_attention` passes to a kernel) and returns what the reference returns,
for tokens >= 1; anything it does not cover raises NotImplementedError naming what, so the caller can run the
reference instead. The kernel is `kernels/latent_prefill.py`.

Memory: the reference builds float32 scores [batch, heads, tokens, slots] and every slot's keys at once; here nothing
grows with tokens x slots. The kernel keeps per program one tile of queries, keys and scores on chip, and writes
the latent context [batch, tokens, heads, range] (range: the value latent channels a KV head reads); the value
up-projection then makes [batch, heads, tokens, head_dim]. Both grow with tokens only. The length stays on the
device and the grid depends on the shapes alone, so a step reads nothing back to the host once the factors' blocks
are known (`triton_decode.prepare`) and the autotuner has chosen a geometry for its shapes.
"""

import torch
import triton
import triton.language as tl

from lrkv_compile.kernels import latent_prefill
from .triton_decode import BITS, DTYPES, _per_head, _side, check_inputs, diagonal_blocks

LONGEST_BUCKET = 1024  # the autotuner tunes once per power of two of the new tokens up to this, once for all longer


def _mask_strides(attn_mask, batch, heads, tokens):
    """(kind, strides over batch, heads, tokens, slots) of the model's mask [batch|1, 1|heads, tokens|1, columns]:
    kind 1 boolean, 2 additive; a broadcast axis gets stride 0."""
    if attn_mask.dim() != 4 or attn_mask.shape[0] not in (1, batch) or attn_mask.shape[1] not in (1, heads) \
            or attn_mask.shape[2] not in (1, tokens):
        raise NotImplementedError(f"attn_mask of shape {tuple(attn_mask.shape)}: expected [batch|1, 1|heads, "
                                  "tokens|1, slots]")
    strides = [attn_mask.stride(axis) if attn_mask.shape[axis] > 1 else 0 for axis in range(3)]
    return (1 if attn_mask.dtype == torch.bool else 2), (*strides, attn_mask.stride(3))


def prefill_attention(*, query, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, positions,
                      new_k, new_v, up_k, bias_k, up_v, bias_v, inv_freq, rope_scale, length, attn_mask,
                      softmax_scale, num_kv_heads, k_bits, k_group, k_sinks, k_axis, k_outliers, v_bits, v_group,
                      v_sinks, v_axis, v_outliers, rope_window=0):
    """`reference.latent_attention` for `tokens` new tokens per sequence (query [batch, heads, tokens, head_dim]),
    on the Triton prefill kernel: the earlier slots read from the cache, this step's from new_k / new_v."""
    batch, heads, tokens, head_dim = query.shape
    device = query.device
    interpret = check_inputs(query, num_kv_heads, inv_freq, "prefill")
    if latent_k.shape[1] < positions.shape[1]:
        raise NotImplementedError("the Triton prefill kernel reads a full-length cache, not a sliding-window ring")
    for name, bits, axis in (("k", k_bits, k_axis), ("v", v_bits, v_axis)):
        if bits not in BITS:
            raise NotImplementedError(f"{name}_bits={bits}: the Triton prefill kernel reads bits {BITS}")
        if axis not in ("token", "channel"):
            raise NotImplementedError(f"{name}_axis={axis!r}: the Triton prefill kernel reads 'token' and 'channel' "
                                      "scales")
    group = heads // num_kv_heads
    k_blocks = diagonal_blocks(up_k, num_kv_heads)
    v_blocks = diagonal_blocks(up_v, num_kv_heads) if up_v is not None else 1
    # _side reads a side's rank from its new latents and checks the cache's layout; this step's latents go to the
    # kernel whole below. Codes are dequantized in the model's dtype (no PACKED float16 path).
    keys = _side("k", latent_k, k_scale, k_zero, k_exact, new_k[:, :1], k_bits, k_group, k_sinks, k_axis, k_outliers,
                 k_blocks, False)
    values = _side("v", latent_v, v_scale, v_zero, v_exact, new_v[:, :1], v_bits, v_group, v_sinks, v_axis,
                   v_outliers, v_blocks, False)
    v_range = values["BLOCK_RANK"]

    if not isinstance(length, torch.Tensor):
        length = torch.tensor(int(length), device=device)
    length = length.to(device)
    query, new_k, new_v = (tensor if tensor.stride(-1) == 1 else tensor.contiguous()
                           for tensor in (query, new_k, new_v))  # the kernel takes the other strides
    up = up_k.to(query.dtype).contiguous()
    mask_kind, mask, mask_strides, mask_width = 0, query, (0, 0, 0, 0), 0
    if attn_mask is not None:
        mask_kind, mask_strides = _mask_strides(attn_mask, batch, heads, tokens)
        mask, mask_width = attn_mask, attn_mask.shape[3]
    rope = inv_freq is not None
    # [batch, tokens, heads, range]: the absorbed path's output as it is (range is all of rank_v there), else the
    # float32 latent context the up-projection reads
    out = torch.empty(batch, tokens, heads, v_range, dtype=torch.float32 if up_v is not None else query.dtype,
                      device=device)
    k, v = keys, values
    grid = lambda meta: (triton.cdiv(tokens, meta["BLOCK_M"] // group), batch * num_kv_heads,  # noqa: E731
                         triton.cdiv(v_range, v["CHUNK"]))
    latent_prefill.latent_prefill_kernel[grid](
        query, query.stride(0), query.stride(1), query.stride(2),
        k["latent"], k["latent"].stride(0), k["latent"].stride(1), k["scale"], k["zero"], k["scale"].stride(0),
        k["scale"].stride(1), k["exact"], k["exact"].stride(0), k["exact"].stride(1),
        new_k, new_k.stride(0), new_k.stride(1),
        v["latent"], v["latent"].stride(0), v["latent"].stride(1), v["scale"], v["zero"], v["scale"].stride(0),
        v["scale"].stride(1), v["exact"], v["exact"].stride(0), v["exact"].stride(1),
        new_v, new_v.stride(0), new_v.stride(1),
        positions, positions.stride(0), up, up.stride(0),
        bias_k.float().contiguous() if bias_k is not None else query,
        inv_freq.float().contiguous() if rope else query,
        mask, *mask_strides, mask_width, length,
        out, out.stride(0), out.stride(1), out.stride(2),
        softmax_scale * (rope_scale if rope else 1.0),  # RoPE's scale multiplies every key
        tokens, min(1 << (tokens - 1).bit_length(), LONGEST_BUCKET),
        k["width"], k["sinks"], k["window"], v["width"], v["sinks"], v["window"], int(rope_window) if rope else 0,
        KV_HEADS=num_kv_heads, GROUP_HEADS=group, HEAD_DIM=head_dim,
        K_HEADS_PER_BLOCK=num_kv_heads // k_blocks, K_BLOCK_RANK=k["BLOCK_RANK"], K_CHUNK=k["CHUNK"],
        K_BITS=k_bits, K_GROUP=k["GROUP"], K_FAST=k["FAST"], K_EXACT=k["EXACT"], K_CHANNEL=k["CHANNEL"],
        K_OUTLIERS=k["OUTLIERS"],
        V_HEADS_PER_BLOCK=num_kv_heads // v_blocks, V_BLOCK_RANK=v_range, V_CHUNK=v["CHUNK"],
        V_BITS=v_bits, V_GROUP=v["GROUP"], V_FAST=v["FAST"], V_EXACT=v["EXACT"], V_CHANNEL=v["CHANNEL"],
        V_OUTLIERS=v["OUTLIERS"],
        HAS_ROPE=rope, HAS_BIAS=bias_k is not None, MASK_KIND=mask_kind, FAST_MATH=not interpret,
        DTYPE=DTYPES[query.dtype],
        DOT_DTYPE=tl.float32 if interpret else DTYPES[query.dtype],  # the interpreter's dot misreads bf16
        IEEE=query.dtype == torch.float32, WINDOWED=bool(rope_window) and rope)
    if up_v is None:
        return out.view(batch, tokens, heads * v_range)
    return _project_values(out.view(batch, tokens, num_kv_heads, group, v_range), up_v, bias_v, v_blocks, query.dtype)


def _project_values(context, up_v, bias_v, blocks, dtype):
    """[batch, tokens, kv_heads, group, range] float32 latent context -> @ B_v (+ b_v) per KV head, as the reference:
    [batch, heads, tokens, head_dim] in `dtype`."""
    batch, tokens, kv_heads, group, _ = context.shape
    out = torch.einsum("btkgr,krd->bkgtd", context, _per_head(up_v, kv_heads, blocks))
    if bias_v is not None:
        out = out + bias_v.float().view(1, kv_heads, 1, 1, -1)
    return out.reshape(batch, kv_heads * group, tokens, -1).to(dtype)
