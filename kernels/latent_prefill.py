"""Triton prefill attention over the latent cache (any number of new tokens per sequence: a prompt, or a chunk of one
after earlier chunks): the `@triton.jit` code, its autotune configs and their pruner (the launcher, with its checks,
is `lowering/triton_prefill.py`; the oracle is `reference.latent_attention`).

One program per (tile of queries, batch row and KV head, chunk of value channels). A tile of queries is BLOCK_M rows:
BLOCK_M // GROUP_HEADS consecutive new tokens times the GROUP_HEADS query heads that share the KV head, so the keys
a program rebuilds serve every query head of its KV head. Flash-attention style, it walks the slots a tile at a time
and keeps only the online softmax state (max and sum per row, the latent context [BLOCK_M, V_CHUNK]): nothing it
holds grows with tokens x slots, and the only buffer in memory is the output. Per tile of BLOCK_S slots it reads the
key latents of the KV head's block of channels (`latent_tiles.latent_tile`: 16-bit, or codes dequantized, with the
exact sink and window copies), rebuilds the keys c B_k + b_k on tensor cores, turns them to each slot's stored
position (rotate-half RoPE from inv_freq), scores them against the tile's queries, applies causality (slot <=
the query's sequence index) and the model's mask, and accumulates p C_v in latent space. The earlier steps' slots
[0, length - tokens) come from the cache, in a loop of their own; this step's come from new_k / new_v, exact, as the
reference takes them.

Scores stay in natural units until the exponent (exp2((s - m) log2 e)): an additive mask's finfo.min then absorbs
the score exactly as it does in the reference's float32 softmax on CPU (a row masked everywhere attends uniformly),
where scaling the mask by log2 e would overflow to -inf.
"""
import os

import triton
import triton.language as tl

from .latent_decode import LOG2E, _exp2, _mm, _reduce_angle, _trig
from .latent_tiles import latent_tile

# (BLOCK_M, BLOCK_S, warps, stages): query rows per program, slots per tile
CONFIGS = [triton.Config({"BLOCK_M": rows, "BLOCK_S": slots}, num_warps=warps, num_stages=stages)
           for rows, slots, warps, stages in ((16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (32, 64, 4, 2),
                                              (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2),
                                              (128, 64, 8, 2), (128, 64, 8, 3))]
# the interpreter (CPU tests) runs one small geometry: several tiles of queries and of slots even in small cases
INTERPRETER_SLOTS = 16


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def prune_configs(configs, named_args, **kwargs):
    """The configs worth timing for this call: a tile holds at least one token of every query head of the KV head
    (BLOCK_M >= GROUP_HEADS) and no more rows than the call has (tokens_bucket x GROUP_HEADS, rounded up to a power
    of two, at least 16). Under the interpreter, one: the smallest tile of queries and INTERPRETER_SLOTS slots."""
    group = kwargs["GROUP_HEADS"]
    least = max(16, _pow2(group))
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BLOCK_M": least, "BLOCK_S": INTERPRETER_SLOTS}, num_warps=4, num_stages=1)]
    most = max(least, _pow2(named_args["tokens_bucket"] * group))
    return [config for config in configs if least <= config.kwargs["BLOCK_M"] <= most]


@triton.jit
def _latents(side, new, b, t0, slots, slot_ok, earlier, ch0, ch_hi, length, NEW: tl.constexpr, BITS: tl.constexpr,
             GROUP: tl.constexpr, FAST: tl.constexpr, EXACT: tl.constexpr, CHANNEL: tl.constexpr,
             OUTLIERS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, DTYPE: tl.constexpr,
             EVEN: tl.constexpr, STORED: tl.constexpr):
    """One side's latents [BLOCK_S, CHUNK] (channels ch0.. below ch_hi) of `slots` in DTYPE: NEW, this step's exact
    ones (slot s is row s - earlier of new [batch, tokens, rank]); else the earlier steps' as the cache holds them
    after this step's write (`length` slots written). side: the cache's side (`latent_tiles.latent_tile`); new:
    (pointer, batch stride, token stride) of this step's latents."""
    if NEW:
        new_ptr, new_sb, new_st = new
        ch = ch0 + tl.arange(0, CHUNK)
        at = new_ptr + b * new_sb + (slots - earlier)[:, None] * new_st + ch[None, :]
        values = tl.load(at, mask=slot_ok[:, None] & (ch < ch_hi)[None, :], other=0.0).to(DTYPE)
    else:
        values = latent_tile(side, b, t0, slots, slot_ok, ch0, ch_hi, length, BITS, GROUP, FAST,
                             EXACT, CHANNEL, OUTLIERS, CHUNK, BLOCK_S, DTYPE, EVEN, False, STORED)
    return values


@triton.jit
def _attend_tile(m_i, l_i, acc, t0, hi, earlier, length, b, q1, q2, query_index, row_ok, mask_rows, inv_freq,
                 qk_scale, pos_ptr, pos_sb, mask_ptr, mask_ss, mask_width, far1, far2, query_at, rope_window,
                 k_cache, k_new, k_lo, k_hi, up1, up2, up_k_ptr, up_k_sr, col, bias1, bias2, v_cache, v_new, v_lo, v_hi,
                 NEW: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                 K_BLOCK_RANK: tl.constexpr, K_CHUNK: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                 K_FAST: tl.constexpr, K_EXACT: tl.constexpr, K_CHANNEL: tl.constexpr, K_OUTLIERS: tl.constexpr,
                 K_STORED: tl.constexpr,
                 V_BLOCK_RANK: tl.constexpr, V_CHUNK: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                 V_FAST: tl.constexpr, V_EXACT: tl.constexpr, V_CHANNEL: tl.constexpr, V_OUTLIERS: tl.constexpr,
                 V_STORED: tl.constexpr,
                 HAS_ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, FAST_MATH: tl.constexpr,
                 DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, WINDOWED: tl.constexpr):
    """Slots t0.. (below hi) into the online softmax state of the tile's queries: m_i, l_i [BLOCK_M] (max and sum, in
    natural units) and acc [BLOCK_M, V_CHUNK]. Keys [BLOCK_S, HALF] x 2 rebuilt from the latents (c B_k + b_k, the
    KV head's columns, a chunk of latent channels at a time) and turned by R(p) at each slot's position p, scores
    q k^T, visible where slot <= the query's sequence index and the mask allows, then acc += p C_v. WINDOWED
    (windowed RoPE): where the slot's position is rope_window or more behind the query's (query_at), the score is
    the unturned key's against the query turned to the window's edge (far1, far2: R(rope_window - p_q) q)."""
    ONE_K_CHUNK: tl.constexpr = K_BLOCK_RANK <= K_CHUNK
    slots = t0 + tl.arange(0, BLOCK_S)
    slot_ok = slots < hi
    key1 = tl.zeros([BLOCK_S, HALF], tl.float32)  # the keys' two halves
    key2 = tl.zeros([BLOCK_S, HALF], tl.float32)
    for c in range(0, K_BLOCK_RANK, K_CHUNK):  # one chunk for head-wise factors, many for joint ones
        latent = _latents(k_cache, k_new, b, t0, slots, slot_ok, earlier, k_lo + c, k_hi, length, NEW, K_BITS,
                          K_GROUP, K_FAST, K_EXACT, K_CHANNEL, K_OUTLIERS, K_CHUNK, BLOCK_S, DTYPE,
                          K_BLOCK_RANK % K_CHUNK == 0, K_STORED)
        if ONE_K_CHUNK:
            right1, right2 = up1, up2
        else:
            rows = k_lo + c + tl.arange(0, K_CHUNK)
            up_at = up_k_ptr + rows[:, None] * up_k_sr + col[None, :]
            right1 = tl.load(up_at, mask=(rows < k_hi)[:, None], other=0.0)
            right2 = tl.load(up_at + HALF, mask=(rows < k_hi)[:, None], other=0.0)
        key1 = _mm(latent, right1, key1, DOT_DTYPE, IEEE)
        key2 = _mm(latent, right2, key2, DOT_DTYPE, IEEE)
    if HAS_BIAS:
        key1 += bias1
        key2 += bias2
    if WINDOWED:
        far = _mm(far1, tl.trans(key1), tl.zeros([BLOCK_M, BLOCK_S], tl.float32), DOT_DTYPE, IEEE)
        far = _mm(far2, tl.trans(key2), far, DOT_DTYPE, IEEE)
    if HAS_ROPE:
        pos = tl.load(pos_ptr + b * pos_sb + slots, mask=slot_ok, other=0)
        cos, sin = _trig(_reduce_angle(pos.to(tl.float32)[:, None] * inv_freq[None, :]), FAST_MATH)
        key1, key2 = key1 * cos - key2 * sin, key2 * cos + key1 * sin
    scores = _mm(q1, tl.trans(key1), tl.zeros([BLOCK_M, BLOCK_S], tl.float32), DOT_DTYPE, IEEE)
    scores = _mm(q2, tl.trans(key2), scores, DOT_DTYPE, IEEE)
    if WINDOWED:
        scores = tl.where(query_at[:, None] - pos[None, :] >= rope_window, far, scores)
    scores = scores * qk_scale
    visible = row_ok[:, None] & slot_ok[None, :] & (slots[None, :] <= query_index[:, None])
    if MASK_KIND != 0:  # columns past the mask's last are not visible (the reference cannot index them)
        visible = visible & (slots < mask_width)[None, :]
        at = mask_ptr + mask_rows[:, None] + slots[None, :] * mask_ss
        if MASK_KIND == 1:
            visible = visible & (tl.load(at, mask=visible, other=0) != 0)
        else:  # added as the reference adds it: finfo.min stays finite
            scores += tl.load(at, mask=visible, other=0.0).to(tl.float32)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: keep every weight 0
    alpha = _exp2((m_i - m_use) * LOG2E, FAST_MATH)
    p = _exp2((scores - m_use[:, None]) * LOG2E, FAST_MATH)
    values = _latents(v_cache, v_new, b, t0, slots, slot_ok, earlier, v_lo, v_hi, length, NEW, V_BITS, V_GROUP,
                      V_FAST, V_EXACT, V_CHANNEL, V_OUTLIERS, V_CHUNK, BLOCK_S, DTYPE, V_BLOCK_RANK % V_CHUNK == 0,
                      V_STORED)
    acc = _mm(p, values, acc * alpha[:, None], DOT_DTYPE, IEEE)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.autotune(configs=CONFIGS, key=["tokens_bucket", "HEAD_DIM", "GROUP_HEADS", "K_BLOCK_RANK", "K_CHUNK", "K_BITS",
                                       "V_BLOCK_RANK", "V_CHUNK", "V_BITS", "MASK_KIND", "WINDOWED"],
                 prune_configs_by={"early_config_prune": prune_configs})
@triton.jit
def latent_prefill_kernel(
        query_ptr, q_sb, q_sh, q_st,
        k_lat_ptr, k_lat_sb, k_lat_ss, k_lat_sk, k_scale_ptr, k_zero_ptr, k_sz_sb, k_sz_ss, k_sz_sk, k_exact_ptr,
        k_ex_sb, k_ex_ss,
        new_k_ptr, new_k_sb, new_k_st,
        v_lat_ptr, v_lat_sb, v_lat_ss, v_lat_sk, v_scale_ptr, v_zero_ptr, v_sz_sb, v_sz_ss, v_sz_sk, v_exact_ptr,
        v_ex_sb, v_ex_ss,
        new_v_ptr, new_v_sb, new_v_st,
        pos_ptr, pos_sb, up_k_ptr, up_k_sr, bias_k_ptr, inv_freq_ptr,
        mask_ptr, mask_sb, mask_sh, mask_st, mask_ss, mask_width, length_ptr,
        out_ptr, out_sb, out_st, out_sh,
        qk_scale, tokens, tokens_bucket, k_width, k_sinks, k_window, v_width, v_sinks, v_window,
        rope_window,
        KV_HEADS: tl.constexpr, GROUP_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        K_HEADS_PER_BLOCK: tl.constexpr, K_BLOCK_RANK: tl.constexpr, K_CHUNK: tl.constexpr,
        K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_FAST: tl.constexpr, K_EXACT: tl.constexpr,
        K_CHANNEL: tl.constexpr, K_OUTLIERS: tl.constexpr, K_STORED: tl.constexpr,
        V_HEADS_PER_BLOCK: tl.constexpr, V_BLOCK_RANK: tl.constexpr, V_CHUNK: tl.constexpr,
        V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_FAST: tl.constexpr, V_EXACT: tl.constexpr,
        V_CHANNEL: tl.constexpr, V_OUTLIERS: tl.constexpr, V_STORED: tl.constexpr,
        HAS_ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, FAST_MATH: tl.constexpr,
        DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, WINDOWED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """Attention of one tile of queries (row r: new token tile * (BLOCK_M // GROUP_HEADS) + r // GROUP_HEADS, query
    head r % GROUP_HEADS of the KV head) over the slots it sees, into out [batch, tokens, heads, V_BLOCK_RANK]
    (channels v_part * V_CHUNK..): the context in the latent space of the KV head's block of C_v, 0 for a query that
    sees no slot. MASK_KIND 0 none, 1 boolean, 2 additive; tokens_bucket keys the autotuner and its pruner;
    WINDOWED: windowed RoPE beyond rope_window positions (`_attend_tile`)."""
    tile, pid_bh, v_part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = pid_bh // KV_HEADS, pid_bh % KV_HEADS
    # each side of the cache as latent_tiles.latent_tile takes it, and this step's latents
    k_cache = (k_lat_ptr, k_lat_sb, k_lat_ss, k_lat_sk, k_scale_ptr, k_zero_ptr, k_sz_sb, k_sz_ss, k_sz_sk,
               k_exact_ptr, k_ex_sb, k_ex_ss, k_width, k_sinks, k_window)
    v_cache = (v_lat_ptr, v_lat_sb, v_lat_ss, v_lat_sk, v_scale_ptr, v_zero_ptr, v_sz_sb, v_sz_ss, v_sz_sk,
               v_exact_ptr, v_ex_sb, v_ex_ss, v_width, v_sinks, v_window)
    k_new, v_new = (new_k_ptr, new_k_sb, new_k_st), (new_v_ptr, new_v_sb, new_v_st)
    HALF: tl.constexpr = HEAD_DIM // 2
    TILE_TOKENS: tl.constexpr = BLOCK_M // GROUP_HEADS
    ONE_K_CHUNK: tl.constexpr = K_BLOCK_RANK <= K_CHUNK
    length = tl.load(length_ptr).to(tl.int32)
    earlier = length - tokens  # slots of earlier steps, read from the cache
    r = tl.arange(0, BLOCK_M)
    token = tile * TILE_TOKENS + r // GROUP_HEADS
    head = h * GROUP_HEADS + r % GROUP_HEADS
    row_ok = (r < TILE_TOKENS * GROUP_HEADS) & (token < tokens)
    query_index = earlier + token  # the query's sequence index: it sees slots up to it
    d = tl.arange(0, HALF)
    b64 = b.to(tl.int64)  # a batch row's offset in the query, the output or the mask may pass 2^31
    q_at = query_ptr + b64 * q_sb + head[:, None] * q_sh + token[:, None] * q_st + d[None, :]
    q1 = tl.load(q_at, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)                  # [BLOCK_M, HALF]
    q2 = tl.load(q_at + HALF, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    mask_rows = b64 * mask_sb + head.to(tl.int64) * mask_sh + token.to(tl.int64) * mask_st
    inv_freq = d.to(tl.float32)
    if HAS_ROPE:
        inv_freq = tl.load(inv_freq_ptr + d).to(tl.float32)
    far1, far2, query_at = 0.0, 0.0, 0
    if WINDOWED:  # the queries turned to the window's edge: R(rope_window - p_q) q
        query_at = tl.load(pos_ptr + b * pos_sb + query_index, mask=row_ok, other=0)
        cos_f, sin_f = _trig(_reduce_angle((rope_window - query_at).to(tl.float32)[:, None] * inv_freq[None, :]),
                             FAST_MATH)
        q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
        far1, far2 = (q1f * cos_f - q2f * sin_f).to(DOT_DTYPE), (q2f * cos_f + q1f * sin_f).to(DOT_DTYPE)
    col = h * HEAD_DIM + d
    bias1, bias2 = 0.0, 0.0
    if HAS_BIAS:
        bias1 = tl.load(bias_k_ptr + col).to(tl.float32)[None, :]
        bias2 = tl.load(bias_k_ptr + col + HALF).to(tl.float32)[None, :]
    k_lo = (h // K_HEADS_PER_BLOCK) * K_BLOCK_RANK
    k_hi = k_lo + K_BLOCK_RANK
    up1, up2 = 0.0, 0.0  # joint factors: loaded a chunk at a time in each tile
    if ONE_K_CHUNK:  # the KV head's whole block of the factor, once
        rows = k_lo + tl.arange(0, K_CHUNK)
        up_at = up_k_ptr + rows[:, None] * up_k_sr + col[None, :]
        up1 = tl.load(up_at, mask=(rows < k_hi)[:, None], other=0.0).to(DOT_DTYPE)
        up2 = tl.load(up_at + HALF, mask=(rows < k_hi)[:, None], other=0.0).to(DOT_DTYPE)
    v_block = (h // V_HEADS_PER_BLOCK) * V_BLOCK_RANK
    v_lo = v_block + v_part * V_CHUNK
    v_hi = v_block + V_BLOCK_RANK
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_CHUNK], tl.float32)  # the latent context
    seen = earlier + tl.minimum(tokens, (tile + 1) * TILE_TOKENS)  # this step's slots the tile's last query sees
    # earlier steps' slots (all of them precede every query), then this step's, from its exact latents
    for new in tl.static_range(2):
        lo, hi = 0, earlier
        if new:
            lo, hi = earlier, seen
        for t0 in range(lo, hi, BLOCK_S):
            m_i, l_i, acc = _attend_tile(
                m_i, l_i, acc, t0, hi, earlier, length, b, q1, q2, query_index, row_ok, mask_rows, inv_freq,
                qk_scale, pos_ptr, pos_sb, mask_ptr, mask_ss, mask_width, far1, far2, query_at, rope_window,
                k_cache, k_new, k_lo, k_hi, up1, up2, up_k_ptr, up_k_sr, col, bias1, bias2, v_cache, v_new, v_lo,
                v_hi, new == 1, HALF, BLOCK_M, BLOCK_S,
                K_BLOCK_RANK, K_CHUNK, K_BITS, K_GROUP, K_FAST, K_EXACT, K_CHANNEL, K_OUTLIERS, K_STORED,
                V_BLOCK_RANK, V_CHUNK, V_BITS, V_GROUP, V_FAST, V_EXACT, V_CHANNEL, V_OUTLIERS, V_STORED,
                HAS_ROPE, HAS_BIAS, MASK_KIND, FAST_MATH, DTYPE, DOT_DTYPE, IEEE, WINDOWED)
    context = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    ch = v_part * V_CHUNK + tl.arange(0, V_CHUNK)
    out_at = out_ptr + b64 * out_sb + token[:, None] * out_st + head[:, None] * out_sh + ch[None, :]
    tl.store(out_at, context, mask=row_ok[:, None] & (ch < V_BLOCK_RANK)[None, :])
