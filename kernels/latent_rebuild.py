"""One layer's keys and value latents rebuilt from the latent cache into dense buffers, for a prefill chunk long
enough that attention over them (`F.scaled_dot_product_attention`, flash-style) beats re-reading the latents per
tile of queries: the `@triton.jit` code (the launcher is `lowering/triton_prefill.py`; the oracle for the keys is
`reference.reconstruct_keys` over `reference.read_latents`).

One program per (tile of BLOCK_S slots, batch row and KV head). It reads the tile's key latents of the KV head's
block of channels as the prefill kernel reads them (`latent_prefill._latents`: this step's exact latents (NEW), or
the cache's dequantized codes with their exact sink and window copies), rebuilds the keys c B_k + b_k on tensor
cores, turns them to each slot's stored position (rotate-half RoPE from inv_freq, without the rotary scale: the
launcher folds it into the softmax scale), and stores them in the model's dtype; then copies the value latents of
the KV head's block the same way. Each slot is read once, whatever the number of queries.
"""
import triton
import triton.language as tl

from .latent_decode import _mm, _reduce_angle, _trig
from .latent_prefill import _latents


@triton.jit
def rebuild_kernel(
        k_lat_ptr, k_lat_sb, k_lat_ss, k_lat_sk, k_scale_ptr, k_zero_ptr, k_sz_sb, k_sz_ss, k_sz_sk, k_exact_ptr,
        k_ex_sb, k_ex_ss,
        new_k_ptr, new_k_sb, new_k_st,
        v_lat_ptr, v_lat_sb, v_lat_ss, v_lat_sk, v_scale_ptr, v_zero_ptr, v_sz_sb, v_sz_ss, v_sz_sk, v_exact_ptr,
        v_ex_sb, v_ex_ss,
        new_v_ptr, new_v_sb, new_v_st,
        pos_ptr, pos_sb, up_k_ptr, up_k_sr, bias_k_ptr, inv_freq_ptr,
        keys_ptr, keys_sb, keys_sh, keys_ss, plain_ptr, values_ptr, values_sb, values_sh, values_ss,
        length_ptr, tokens, k_width, k_sinks, k_window, v_width, v_sinks, v_window,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        K_HEADS_PER_BLOCK: tl.constexpr, K_BLOCK_RANK: tl.constexpr, K_CHUNK: tl.constexpr,
        K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_FAST: tl.constexpr, K_EXACT: tl.constexpr,
        K_CHANNEL: tl.constexpr, K_OUTLIERS: tl.constexpr, K_STORED: tl.constexpr,
        V_HEADS_PER_BLOCK: tl.constexpr, V_BLOCK_RANK: tl.constexpr, V_CHUNK: tl.constexpr,
        V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_FAST: tl.constexpr, V_EXACT: tl.constexpr,
        V_CHANNEL: tl.constexpr, V_OUTLIERS: tl.constexpr, V_STORED: tl.constexpr,
        HAS_ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_MATH: tl.constexpr, DTYPE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, NEW: tl.constexpr, PLAIN: tl.constexpr, BLOCK_S: tl.constexpr):
    """keys [batch, KV_HEADS, slots, HEAD_DIM] and values [batch, KV_HEADS, slots, V_BLOCK_RANK] (DTYPE) of the slots
    [0, earlier) read from the cache, or with NEW of this step's [earlier, length) from new_k / new_v (length: the
    slots written, on the device; earlier = length - tokens). With PLAIN (windowed RoPE) the keys also go unturned,
    as the projection made them, to plain_ptr (the strides of keys). Programs past those slots store nothing."""
    tile, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // KV_HEADS, pid_bh % KV_HEADS
    k_cache = (k_lat_ptr, k_lat_sb, k_lat_ss, k_lat_sk, k_scale_ptr, k_zero_ptr, k_sz_sb, k_sz_ss, k_sz_sk,
               k_exact_ptr, k_ex_sb, k_ex_ss, k_width, k_sinks, k_window)
    v_cache = (v_lat_ptr, v_lat_sb, v_lat_ss, v_lat_sk, v_scale_ptr, v_zero_ptr, v_sz_sb, v_sz_ss, v_sz_sk,
               v_exact_ptr, v_ex_sb, v_ex_ss, v_width, v_sinks, v_window)
    k_new, v_new = (new_k_ptr, new_k_sb, new_k_st), (new_v_ptr, new_v_sb, new_v_st)
    HALF: tl.constexpr = HEAD_DIM // 2
    length = tl.load(length_ptr).to(tl.int32)
    earlier = length - tokens
    hi = length if NEW else earlier
    t0 = (earlier if NEW else 0) + tile * BLOCK_S
    slots = t0 + tl.arange(0, BLOCK_S)
    slot_ok = slots < hi
    b64 = b.to(tl.int64)  # a batch row's offset in the buffers may pass 2^31
    d = tl.arange(0, HALF)
    col = h * HEAD_DIM + d
    k_lo = (h // K_HEADS_PER_BLOCK) * K_BLOCK_RANK
    k_hi = k_lo + K_BLOCK_RANK
    key1 = tl.zeros([BLOCK_S, HALF], tl.float32)  # the keys' two halves
    key2 = tl.zeros([BLOCK_S, HALF], tl.float32)
    for c in range(0, K_BLOCK_RANK, K_CHUNK):  # one chunk for head-wise factors, many for joint ones
        latent = _latents(k_cache, k_new, b, t0, slots, slot_ok, earlier, k_lo + c, k_hi, length, NEW, K_BITS,
                          K_GROUP, K_FAST, K_EXACT, K_CHANNEL, K_OUTLIERS, K_CHUNK, BLOCK_S, DTYPE,
                          K_BLOCK_RANK % K_CHUNK == 0, K_STORED)
        rows = k_lo + c + tl.arange(0, K_CHUNK)
        up_at = up_k_ptr + rows[:, None] * up_k_sr + col[None, :]
        key1 = _mm(latent, tl.load(up_at, mask=(rows < k_hi)[:, None], other=0.0), key1, DOT_DTYPE, IEEE)
        key2 = _mm(latent, tl.load(up_at + HALF, mask=(rows < k_hi)[:, None], other=0.0), key2, DOT_DTYPE, IEEE)
    if HAS_BIAS:
        key1 += tl.load(bias_k_ptr + col).to(tl.float32)[None, :]
        key2 += tl.load(bias_k_ptr + col + HALF).to(tl.float32)[None, :]
    at = b64 * keys_sb + h * keys_sh + slots.to(tl.int64)[:, None] * keys_ss + d[None, :]
    if PLAIN:
        tl.store(plain_ptr + at, key1.to(DTYPE), mask=slot_ok[:, None])
        tl.store(plain_ptr + at + HALF, key2.to(DTYPE), mask=slot_ok[:, None])
    if HAS_ROPE:
        inv_freq = tl.load(inv_freq_ptr + d).to(tl.float32)
        pos = tl.load(pos_ptr + b * pos_sb + slots, mask=slot_ok, other=0)
        cos, sin = _trig(_reduce_angle(pos.to(tl.float32)[:, None] * inv_freq[None, :]), FAST_MATH)
        key1, key2 = key1 * cos - key2 * sin, key2 * cos + key1 * sin
    tl.store(keys_ptr + at, key1.to(DTYPE), mask=slot_ok[:, None])
    tl.store(keys_ptr + at + HALF, key2.to(DTYPE), mask=slot_ok[:, None])
    v_lo = (h // V_HEADS_PER_BLOCK) * V_BLOCK_RANK
    for c in range(0, V_BLOCK_RANK, V_CHUNK):
        values = _latents(v_cache, v_new, b, t0, slots, slot_ok, earlier, v_lo + c, v_lo + V_BLOCK_RANK, length, NEW,
                          V_BITS, V_GROUP, V_FAST, V_EXACT, V_CHANNEL, V_OUTLIERS, V_CHUNK, BLOCK_S, DTYPE,
                          V_BLOCK_RANK % V_CHUNK == 0, V_STORED)
        ch = c + tl.arange(0, V_CHUNK)
        values_at = values_ptr + b64 * values_sb + h * values_sh + slots.to(tl.int64)[:, None] * values_ss + ch[None, :]
        tl.store(values_at, values, mask=slot_ok[:, None] & (ch < V_BLOCK_RANK)[None, :])
