"""Launching the budget-0.2 plan's Gluon far loop (`kernels/gluon_far.py`): `far_splits` for the decode launcher
(`triton_decode.decode_attention_with`, which hands the far slots to it where it can), `far_partials` and `combine`
to run it over a cache on its own (its tests and `benchmarks/far_loop.py`)."""
import functools
import math

import torch

from .launch import launch

BLOCK = 64  # slots per iteration of a program
RANK_K, RANK_V, GROUP = 64, 128, 32  # per KV head: what the loop reads (4-bit keys, 3-bit values, per-token groups)
# programs a multiprocessor the far loop's splits aim at (one wave), by device (`wave`). A one-warp program holds 13 KB
# of shared memory (two stages of 64 slots), so 16 would fit. On an H200 with the stages, 12 suits both shapes (below,
# `REGISTERS`); on an H100 with the stages and the fold, 8 (the decode step, budget 0.2 w1024, ms at 16K and batch 16 /
# 64K and batch 4, at 12 -> 8: Llama-3-8B 0.1261 / 0.1295 -> 0.1223 / 0.1236, Llama-2-7B 0.4056 / 0.3450 -> 0.3996 /
# 0.3392; 5, 6, 7, 9, 10, 11, 13 and 16 no faster; docs/gpu-notes.md, "Stop 65")
WAVES = {"H100": 8}  # a part of the device's name -> programs a multiprocessor
WAVE = 12  # elsewhere
# programs a multiprocessor the far loop's splits aim at where the decode kernel (the window's slots) runs beside it on
# a second stream, one of its programs a multiprocessor (`triton_decode.decode_attention_with`), by device; elsewhere
# the two run one after the other. At 4 far programs (4 x 132 registers x 32 lanes, 4 x 13 KB) a multiprocessor holds a
# decode program of 4 warps at 255 registers (47 KB) beside them; at 8 it held none, so a side stream gained 0.6-3%.
# H100, budget 0.2 w1024, ms at 16K and batch 16 / 64K and batch 4, one stream at 8 -> beside at 4: Llama-3-8B
# 0.1224 / 0.1231 -> 0.1077 / 0.1035, Llama-2-7B 0.3997 / 0.3411 -> 0.3536 / 0.3257; 3, 5 and 6 far programs slower
# (docs/gpu-notes.md, "Stop 70"); with the all-true mask of a model's step, Llama-3-8B 0.1267 / 0.1245 -> 0.1119 /
# 0.1062, Llama-2-7B 0.4137 / 0.3445 -> 0.3515 / 0.3287 ("Stop 71": a split the mask keeps whole reads it once).
BESIDE = {"H100": 4}


def _programs(table: dict, device: torch.device, default: int) -> int:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((programs for part, programs in table.items() if part in name), default)


@functools.cache
def wave(device: torch.device) -> int:
    """Programs a multiprocessor the far loop's splits aim at on `device` (`WAVES`, else `WAVE`)."""
    return _programs(WAVES, device, WAVE)


@functools.cache
def beside(device: torch.device) -> int:
    """Programs a multiprocessor the far loop's splits aim at on `device` with the decode kernel beside it on a second
    stream (`BESIDE`); 0 where the two run one after the other (every other device, and the CPU)."""
    return _programs(BESIDE, device, 0)


# registers a thread of the far loop (no spill): 12 programs a multiprocessor fit. The decode step on an H200
# (budget 0.2 w1024, ms at 16K and batch 16 / 64K and batch 4), before the fold (`folds`): Llama-3-8B 0.114 / 0.122
# at 128 registers and 16 programs a multiprocessor, 0.110 / 0.112 at 168 and 12, 0.111 / 0.112 at 255 and 8;
# Llama-2-7B 0.355 / 0.305 at 128 and 12, 0.362 / 0.359 at 168 and 9, 0.362 / 0.371 at 255 and 6. The folded loop
# spills at 128.
REGISTERS = 168


def folds(group: int) -> bool:
    """Whether the far loop takes the scales and zero points out of the codes (`far_kernel`'s FOLD): where a KV head
    serves one query head, whose scores and weights leave seven of the products' eight columns free."""
    return group == 1


@functools.cache
def key_order(device: torch.device) -> torch.Tensor:
    """The key ranks' channels (key_rank_channels) as an index tensor on `device`, made once: no host copy per
    launch, so a launch can be captured in a CUDA graph."""
    from lrkv_compile.kernels import gluon_far

    return torch.tensor(gluon_far.key_rank_channels(), device=device)


def kernel_queries(far_queries: torch.Tensor) -> torch.Tensor:
    """Latent queries [rows, kv_heads, group <= 8, 64] (scores = query . keys, base 2) -> the kernel's float16
    [rows * kv_heads, 8, 64], ranks in key_rank_channels' order, zero columns past the group."""
    rows, kv_heads, group, _ = far_queries.shape
    out = torch.zeros(rows * kv_heads, 8, RANK_K, dtype=torch.float16, device=far_queries.device)
    out[:, :group] = far_queries.reshape(rows * kv_heads, group, RANK_K)[..., key_order(far_queries.device)]
    return out


def far_splits(*, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, queries, far_hi, sinks,
               splits, row_splits, part_max, part_sum, part_acc, kv_heads, group, attn_mask=None):
    """Launch the far loop over the far slots of each batch row b, [0, far_end): far_hi int32 [rows * kv_heads] on
    the GPU, far_end the least of row b's entries rounded down to a multiple of 64 (`latent_decode.far_prep_kernel`'s
    firsts; the first `sinks` slots from k_exact and v_exact), in `splits` splits per (row, KV head), writing the
    first splits of the decode kernel's partial buffers (row_splits splits each). queries: float16 [rows * kv_heads,
    8, 64] (kernel_queries', or far_prep_kernel's). attn_mask: None or the step's boolean mask [rows or 1, 1, 1,
    slots] (false: not attended)."""
    from lrkv_compile.kernels import gluon_far

    rows = far_hi.numel() // kv_heads  # the step's rows: the cache may hold more
    assert queries.shape[0] == rows * kv_heads, (tuple(queries.shape), rows, kv_heads)
    key_words, value_words = latent_k.view(torch.int32), latent_v.view(torch.int32)
    exact_k = k_exact if sinks else queries
    exact_v = v_exact if sinks else queries
    mask, mask_sb, mask_ss = _mask_strides(attn_mask, rows, queries)
    kw_sb, kw_sh, kw_ss = _strides(key_words, 8)
    vw_sb, vw_sh, vw_ss = _strides(value_words, 12)
    scale_words = [side.view(torch.int32) for side in (k_scale, k_zero, v_scale, v_zero)]  # float16 pairs
    ks_sb, ks_sh, ks_ss = _strides(scale_words[0], 1)
    vs_sb, vs_sh, vs_ss = _strides(scale_words[2], 2)
    if (kw_sh % 4 or vw_sh % 4 or vs_sh % 2 or _strides(scale_words[1], 1) != (ks_sb, ks_sh, ks_ss)
            or _strides(scale_words[3], 2) != (vs_sb, vs_sh, vs_ss)):
        raise NotImplementedError(f"far loop: the codes' head strides must be multiples of 16 bytes (key codes "
                                  f"{4 * kw_sh} bytes, value codes {4 * vw_sh}), the value scales' of 8 bytes "
                                  f"({4 * vs_sh}), and the zero points laid out as the scales (key scales "
                                  f"{_strides(k_scale, 2)}, zero points {_strides(k_zero, 2)}; value scales "
                                  f"{_strides(v_scale, 4)}, zero points {_strides(v_zero, 4)})")
    fold = folds(group)  # the value scales then go to the kernel as float16 (their strides still in words)
    launch(gluon_far.far_kernel, (rows * kv_heads, splits), (
        key_words, *scale_words[:2], value_words, *((v_scale, v_zero) if fold else scale_words[2:]), exact_k, exact_v,
        queries, far_hi, mask, part_max, part_sum, part_acc, kw_sb, kw_sh // 4, ks_sb, ks_sh, vw_sb, vw_sh // 4, vs_sb,
        vs_sh // 2, exact_k.stride(0), exact_k.stride(1) if sinks else 0, exact_v.stride(0),
        exact_v.stride(1) if sinks else 0, mask_sb, splits, row_splits),
        dict(kw_ss=kw_ss, ks_ss=ks_ss, vw_ss=vw_ss, vs_ss=vs_ss, mask_ss=mask_ss, KV_HEADS=kv_heads,
             GROUP_HEADS=group, SINKS=sinks, HAS_MASK=attn_mask is not None, FOLD=fold, num_warps=1,
             maxnreg=REGISTERS))


def _strides(tensor, per_head):
    """(row, KV head, slot) strides, in elements, of one of a side's tensors as the far loop reads it: the cache's
    row layout [rows, slots, kv_heads * per_head] (every KV head of a slot in one row), or a view [rows, slots,
    kv_heads, per_head] with a last stride of 1, such as head-major storage (each KV head's slots in one run:
    `benchmarks/far_loop.py` times both). Codes, scales and zero points are read as int32 words (their byte strides
    and offsets multiples of 4; the codes' head strides of 16 bytes and the value scales' of 8: `far_splits` refuses
    others), the zero points with the scales' strides."""
    if tensor.dim() == 4:
        return tensor.stride(0), tensor.stride(2), tensor.stride(1)
    return tensor.stride(0), per_head, tensor.stride(1)


def head_major(tensor, kv_heads):
    """A copy of a side's tensor [rows, slots, kv_heads * per KV head] stored head-major (each KV head's slots in one
    run), as the view [rows, slots, kv_heads, per KV head] the far loop reads (`_strides`)."""
    rows, slots, width = tensor.shape
    return tensor.view(rows, slots, kv_heads, width // kv_heads).transpose(1, 2).contiguous().transpose(1, 2)


def reads_mask(attn_mask, rows: int) -> bool:
    """Whether the far loop reads this mask: none, or a boolean one [rows or 1, 1, 1, slots] (transformers' SDPA
    mask in a decode step)."""
    return attn_mask is None or (attn_mask.dtype == torch.bool and attn_mask.dim() == 4
                                 and attn_mask.shape[1:3] == (1, 1) and attn_mask.shape[0] in (1, rows))


def _mask_strides(attn_mask, rows, placeholder):
    """A boolean mask [rows or 1, 1, 1, slots] as the far loop reads it: the tensor, its batch stride (0 where one
    mask serves every row) and its slot stride; a placeholder and zeros without one."""
    if attn_mask is None:
        return placeholder, 0, 0
    if not reads_mask(attn_mask, rows):
        raise NotImplementedError(f"far loop: a boolean mask [{rows} or 1, 1, 1, slots] only, not {attn_mask.dtype} "
                                  f"{tuple(attn_mask.shape)}")
    return attn_mask, attn_mask.stride(0) if attn_mask.shape[0] == rows else 0, attn_mask.stride(3)


def reference_far_splits(*, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, queries, far_hi,
                          sinks, splits, row_splits, part_max, part_sum, part_acc, kv_heads, group, attn_mask=None):
    """`far_splits` in torch, from the dequantized cache (its oracle, and its stand-in on a CPU, where Gluon kernels
    do not run: the decode launcher's far-loop path is tested there with it). Reads far_hi on the host."""
    from .quantize import dequantize, rows_of

    latent = torch.empty(queries.shape[0], group, RANK_K, device=queries.device)
    latent[..., key_order(queries.device)] = queries[:, :group].float()
    acc, flat_max, flat_sum = part_acc.view(-1, RANK_V), part_max.view(-1), part_sum.view(-1)
    firsts = far_hi.view(-1, kv_heads).amin(1).tolist()
    for b, end in enumerate(first // BLOCK * BLOCK for first in firsts):
        keys = dequantize(*(rows_of(side[b, :end]) for side in (latent_k, k_scale, k_zero)), 4, GROUP)
        values = dequantize(*(rows_of(side[b, :end]) for side in (latent_v, v_scale, v_zero)), 3, GROUP)
        keys, values = keys.view(end, kv_heads, RANK_K), values.view(end, kv_heads, RANK_V)
        if sinks and end:
            keys[:sinks] = k_exact[b, :sinks].float().view(sinks, kv_heads, RANK_K)
            values[:sinks] = v_exact[b, :sinks].float().view(sinks, kv_heads, RANK_V)
        per_split = math.ceil(math.ceil(end / splits) / BLOCK) * BLOCK if end else 0
        for h in range(kv_heads):
            for split in range(splits):
                rows = ((b * kv_heads + h) * row_splits + split) * group + torch.arange(group)
                lo, hi = split * per_split, min(split * per_split + per_split, end)
                scores = latent[b * kv_heads + h] @ keys[lo:hi, h].T  # [group, slots]
                if attn_mask is not None:
                    scores[:, ~attn_mask[b % attn_mask.shape[0], 0, 0, lo:hi]] = -math.inf
                top = scores.amax(-1) if hi > lo else torch.full((group,), -math.inf, device=scores.device)
                weights = torch.exp2(scores - top.nan_to_num(neginf=0.0)[:, None])
                flat_max[rows] = top
                flat_sum[rows] = weights.sum(-1)
                acc[rows] = weights @ values[lo:hi, h]


def _check(name, tensor, shape):
    if tuple(tensor.shape) != tuple(shape):
        raise NotImplementedError(f"far loop: {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} (4-bit "
                                  f"keys of rank 64 and 3-bit values of rank 128 per KV head, groups of 32 channels "
                                  f"per token)")


def far_partials(latent_k, k_scale, k_zero, latent_v, v_scale, v_zero, query, splits: int):
    """Per split of the slots, the partial softmax of `query` over the cached latents, no slot exact.

    latent_k uint8 [rows, slots, kv_heads * 32], k_scale, k_zero float16 [rows, slots, kv_heads * 2], latent_v uint8
    [rows, slots, kv_heads * 48], v_scale, v_zero float16 [rows, slots, kv_heads * 4] (the cache's layout,
    `lowering/quantize.py`), or views [rows, slots, kv_heads, per KV head] of other storage (`_strides`); query
    [rows, kv_heads, group <= 8, 64]: latent queries, scores = query . keys in base 2. slots must be whole 64-slot
    tiles. Returns (m, l [rows, kv_heads, splits, group], ctx [rows, kv_heads, splits, group, 128]): the running
    maximum, the sum of 2^(score - m) and the unnormalized latent context (`combine`)."""
    rows, slots = latent_k.shape[:2]
    kv_heads, group = query.shape[1], query.shape[2]
    if latent_k.device.type != "cuda":
        raise NotImplementedError("far loop: the Gluon kernel runs on CUDA tensors only (the reference op is the CPU "
                                  "path)")
    if query.shape[0] != rows or query.shape[3] != RANK_K or not 1 <= group <= 8:
        raise NotImplementedError(f"far loop: query has shape {tuple(query.shape)}, expected [{rows}, kv_heads, 1..8, "
                                  f"{RANK_K}]")
    for name, tensor, per_head in (("latent_k", latent_k, 32), ("k_scale", k_scale, 2), ("k_zero", k_zero, 2),
                                   ("latent_v", latent_v, 48), ("v_scale", v_scale, 4), ("v_zero", v_zero, 4)):
        if tensor.dim() == 4:  # a view [rows, slots, kv_heads, per_head], e.g. of head-major storage
            _check(name, tensor, (rows, slots, kv_heads, per_head))
            per_word = 4 if tensor.dtype == torch.uint8 else 2  # codes and float16 scales: read as int32 words
            if tensor.stride(3) != 1 or any(x % per_word for x in (*tensor.stride()[:3], tensor.storage_offset())):
                raise NotImplementedError(f"far loop: {name}'s view has strides {tensor.stride()} and offset "
                                          f"{tensor.storage_offset()}: a last stride of 1 only, and the others and "
                                          f"the offset whole 4-byte words")
            continue
        _check(name, tensor, (rows, slots, kv_heads * per_head))
        if not tensor.is_contiguous():
            raise NotImplementedError(f"far loop: {name} must be contiguous (the cache's row layout)")
    if slots % BLOCK or slots == 0:
        raise ValueError(f"far loop: {slots} slots; the loop reads whole tiles of {BLOCK}")
    splits = math.ceil(slots / (math.ceil(slots / max(1, splits) / BLOCK) * BLOCK))  # no empty split
    device = latent_k.device
    m = torch.empty(rows, kv_heads, splits, group, device=device)
    l = torch.empty_like(m)
    ctx = torch.empty(rows, kv_heads, splits, group, RANK_V, device=device)
    far_splits(latent_k=latent_k, k_scale=k_scale, k_zero=k_zero, k_exact=None, latent_v=latent_v, v_scale=v_scale,
               v_zero=v_zero, v_exact=None, queries=kernel_queries(query), sinks=0,
               far_hi=torch.full((rows * kv_heads,), slots, dtype=torch.int32, device=device), splits=splits,
               row_splits=splits, part_max=m, part_sum=l, part_acc=ctx, kv_heads=kv_heads, group=group)
    return m, l, ctx


def combine(m, l, ctx):
    """far_partials' partials -> the normalized latent context [rows, kv_heads, group, 128]."""
    weight = torch.exp2(m - m.amax(2, keepdim=True))
    return (weight[..., None] * ctx).sum(2) / (weight * l).sum(2)[..., None]
