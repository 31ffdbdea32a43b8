"""Launching the budget-0.2 plan's Gluon far loop (`kernels/gluon_far.py`) over a latent cache, and reducing its
partials. The first part of that plan's coming decode kernel: not yet called by the decode op (docs/gpu-notes.md)."""
import functools
import math

import torch

BLOCK = 64  # slots per iteration of a program
# 128 registers a thread: 16 one-warp programs a multiprocessor, no spill (uncapped it takes 134 and ran 15-20% slower
# on an H100); 16 splits fill the H100 at batch 16 and 8 KV heads (docs/gpu-notes.md)
MAX_REGISTERS = 128


@functools.cache
def _orders(device: torch.device):
    """(key ranks' channels, context rows' channels) as index tensors on `device`, made once: no host copy per
    launch, so a launch can be captured in a CUDA graph."""
    from lrkv_compile.kernels import gluon_far

    return (torch.tensor(gluon_far.key_rank_channels(), device=device),
            torch.tensor(gluon_far.value_channels(), device=device))


def _check(name, tensor, shape):
    if tuple(tensor.shape) != tuple(shape):
        raise NotImplementedError(f"far loop: {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} (4-bit keys "
                         f"of rank 64 and 3-bit values of rank 128 per KV head, groups of 32 channels per token)")


def far_partials(latent_k, k_scale, k_zero, latent_v, v_scale, v_zero, query, splits: int):
    """Per split of the slots, the partial softmax of `query` over the cached latents.

    latent_k uint8 [rows, slots, kv_heads * 32], k_scale, k_zero float16 [rows, slots, kv_heads * 2], latent_v uint8
    [rows, slots, kv_heads * 48], v_scale, v_zero float16 [rows, slots, kv_heads * 4] (the cache's layout,
    `lowering/quantize.py`); query [rows, kv_heads, group <= 8, 64]: latent queries, scores = query . keys in base 2.
    slots must be whole 64-slot tiles. Returns (m, l [rows, kv_heads, splits, group], ctx [rows, kv_heads, splits,
    group, 128]): the running maximum, the sum of 2^(score - m) and the unnormalized latent context, its channels in
    the kernel's order (`gluon_far.value_channels`; `combine` puts them back)."""
    from lrkv_compile.kernels import gluon_far

    rows, slots, width = latent_k.shape
    kv_heads, group = query.shape[1], query.shape[2]
    if latent_k.device.type != "cuda":
        raise NotImplementedError("far loop: the Gluon kernel runs on CUDA tensors only (the reference op is the CPU path)")
    if query.shape[0] != rows or query.shape[3] != 64 or not 1 <= group <= 8:
        raise ValueError(f"far loop: query has shape {tuple(query.shape)}, expected [{rows}, kv_heads, 1..8, 64]")
    for name, tensor, per_head in (("latent_k", latent_k, 32), ("k_scale", k_scale, 2), ("k_zero", k_zero, 2),
                                   ("latent_v", latent_v, 48), ("v_scale", v_scale, 4), ("v_zero", v_zero, 4)):
        _check(name, tensor, (rows, slots, kv_heads * per_head))
        if not tensor.is_contiguous():
            raise NotImplementedError(f"far loop: {name} must be contiguous (the cache's row layout)")
    if slots % BLOCK or slots == 0:
        raise ValueError(f"far loop: {slots} slots; the loop reads whole tiles of {BLOCK}")
    per_split = math.ceil(slots / max(1, splits) / BLOCK) * BLOCK
    splits = math.ceil(slots / per_split)  # no empty split
    q = torch.zeros(rows * kv_heads, 8, 64, dtype=torch.float16, device=latent_k.device)
    q[:, :group] = query.reshape(rows * kv_heads, group, 64)[..., _orders(latent_k.device)[0]].to(torch.float16)
    m = torch.empty(rows * kv_heads, splits, 8, device=latent_k.device)
    l = torch.empty_like(m)
    acc = torch.empty(rows * kv_heads, splits, 8, 128, device=latent_k.device)
    key_words, value_words = latent_k.view(torch.int32), latent_v.view(torch.int32)
    gluon_far.far_kernel[(rows * kv_heads, splits)](
        key_words, k_scale, k_zero, value_words, v_scale, v_zero, q, m, l, acc,
        key_words.stride(0), 4, k_scale.stride(0), 2, value_words.stride(0), 12, v_scale.stride(0), 4,
        per_split, slots, splits, kw_ss=key_words.stride(1), ks_ss=k_scale.stride(1), vw_ss=value_words.stride(1),
        vs_ss=v_scale.stride(1), KV_HEADS=kv_heads, num_warps=1, maxnreg=MAX_REGISTERS)
    shape = (rows, kv_heads, splits)
    return m[..., :group].reshape(*shape, group), l[..., :group].reshape(*shape, group), \
        acc[:, :, :group].reshape(*shape, group, 128)


def combine(m, l, ctx):
    """far_partials' partials -> the normalized latent context [rows, kv_heads, group, 128], in the cache's channel
    order."""
    top = m.amax(2, keepdim=True)
    weight = torch.exp2(m - top)
    reduced = (weight[..., None] * ctx).sum(2) / (weight * l).sum(2)[..., None]
    out = torch.empty_like(reduced)
    out[..., _orders(ctx.device)[1]] = reduced
    return out
