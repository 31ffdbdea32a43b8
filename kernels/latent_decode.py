"""Triton decode attention over the latent cache: the `@triton.jit` code only (the launcher, with its checks and
launch geometries, is `lowering/triton_decode.py`; the oracle is `lowering/reference.py`).

One program per (batch row, KV head, split of the slots, chunk of value channels). Per tile of BLOCK_S slots it reads
the key latents of the KV head's own block of channels (all channels for a dense `up_k`) as the reference reads them
(`latent_tiles.py`: 16-bit, or codes unpacked and dequantized), rebuilds the keys on tensor cores with the head's block
of `up_k` (accumulated and turned in float16 for float16 models: KEY_DTYPE), turns them to their positions and scores
them against every query head of the KV head at once, transposed: scores [slots, G_PAD] = keys @ R(-p0)q, so the keys go
from one product's accumulator into the next one's operand in registers. Online softmax in base 2 (the sums kept per
slot, added over the slots once), p·C_v in latent space on tensor cores (for packed value codes as C_vᵀ p, the latent
context held transposed: VALUES_FIRST below). The tiles that may hold exact sink or window copies, those before the run
of consecutive positions below and, with windowed RoPE, the tile across the window's edge (but see ACROSS_BOTH) run
after the others in a loop of their own, so the main loops carry no branch for them (one loop holding both kinds of tile
took 0.147 ms where the two take 0.130: keep 0.25, Llama-3-8B shape, 16K, batch 16, H100). Windowed RoPE's far tiles of
unquantized (16-bit) latents come whole and unmasked by the tensor memory accelerator where the launcher passes tensor
descriptors, k_desc and v_desc: 2-5% faster there on an H100, while the tiles whose keys are rebuilt were slower that
way. A last tile that is not whole then goes with the near tiles (masked) where its positions run on and are near, else
with the edge tiles. Packed key codes' scales are loaded a tile ahead (2-byte loads stay out of the software pipeline).
This step's token comes from its exact latents last. Partial (max, sum, context) per split go to small buffers
[batch*kv_heads, splits, group, channels]; `combine_project_kernel` reduces them and takes them through B_v in the same
launch (`combine_splits_kernel` where the output projection absorbed B_v).

RoPE at a slot's position p = p0 + δ (p0 the tile's first position): q·R(p0 + δ)k = R(-p0)q · R(δ)k. R(δ) for δ <
BLOCK_S is a table made once per program, so no slot pays for a sine. A split first finds the tile boundary from which
its positions run on consecutively to its last slot (its first slot in the usual case; the first boundary after the
pads at left padding): those tiles load no positions, and the queries, turned by R(-p0) once, turn on to the next tile
by R(-BLOCK_S), an fp32 product per tile (full-precision cosines, so the drift over a split's tiles stays near float32
rounding). Each tile before that boundary loads its positions and turns the queries by its own p0, and the keys of a
tile whose positions are not consecutive (e.g. across the pads) turn on by the rest of their angle per slot. With
windowed RoPE the slots far from this step's position need neither: the far tiles before the window are guessed from
the last position of the split's middle range as if the positions ran on, read without a scan and checked as they are
read (a split where one of them is near after all starts over in the edge loop; POSITIONS_AHEAD loads each tile's
positions a tile ahead), and only the window's part of the split is scanned. The tile across the window's edge,
where it is whole, goes through both loops (ACROSS_BOTH), the far one scoring its far slots and the near one the
others, rather than through the edge loop and its sine per slot. Over 16-bit latents a split rebuilds
the window's keys before it reads its far tiles (NEAR_FIRST), so that this compute overlaps the other splits' reads.
fl(p0 f) + fl(δ f) differs from the reference's fl(p f) by float32 rounding of the angle (~1e-4 rad at position 4K
for the fastest frequency); fp32 models take each tile's own angle and correct that to first order (EXACT_ANGLES),
16-bit ones are far coarser than it.

VALUES_FIRST (the launcher's choice, `triton_decode.values_first`: packed value codes on the GPU, the layouts a
float16 GPU would pack under the interpreter): the value product runs as C_vᵀ p, [V_CHUNK, slots] @ [slots, G_PAD],
the channels as the tensor-core product's rows (Hopper's warpgroup product from V_CHUNK 64 on), and the latent
context is held transposed; the dequantized tile reaches the product in fewer shared-memory reads (budget 0.2 plan,
packed codes, Llama-3-8B shape, 16K, batch 16, H200: 0.273 -> 0.251 ms windowed, 0.367 -> 0.332 ms exact). 16-bit
latents keep pᵀ C_v: transposed, keep 0.25 windowed took 0.114 -> 0.195 ms. Other codes keep it too: 8-bit value
codes through C_vᵀ p in 64-slot tiles read NaN or fault on an H100 (Triton 3.6) behind 4-bit or 16-bit keys, where
32-slot tiles read right.
"""
import triton
import triton.language as tl

from .latent_tiles import latent_tile, packed_order, packed_scales_at

LOG2E = tl.constexpr(1.4426950408889634)  # scores go base 2: the launcher's qk_scale holds it, additive masks here


@triton.jit
def _reduce_angle(angle):
    """angle - 2πk in [-π, π] (two-term Cody-Waite), so a fast sine stays accurate at long positions."""
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
    return (angle - turns * 6.28125) - turns * 0.0019353071795864769


@triton.jit
def _mm(a, b, acc, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """a @ b + acc on tensor cores, accumulated in acc's dtype."""
    if IEEE:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision="ieee", out_dtype=acc.dtype)
    return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, out_dtype=acc.dtype)


@triton.jit
def _trig(angle, FAST_MATH: tl.constexpr):
    """cos and sin of angles already reduced to [-π, π]: the multi-function unit's approximations on the GPU
    (absolute error ~1e-6 there), numpy's in the interpreter."""
    if FAST_MATH:
        cos = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [angle], dtype=tl.float32, is_pure=True,
                                        pack=1)
        sin = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [angle], dtype=tl.float32, is_pure=True,
                                        pack=1)
        return cos, sin
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _exp2(x, FAST_MATH: tl.constexpr):
    """2^x: the multi-function unit's approximation on the GPU, flushing results below 2^-126 to 0 (one
    instruction: without .ftz the compiler scales around it), numpy's in the interpreter."""
    if FAST_MATH:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.math.exp2(x)


@triton.jit
def _split_range(length_ptr, num_splits, start, BLOCK_S: tl.constexpr):
    """(length, first slot, end) of this program's split of the slots [start, length) (start a tile boundary):
    whole tiles, as even as the length allows."""
    length = tl.load(length_ptr).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(length - start, num_splits), BLOCK_S) * BLOCK_S
    s_lo = start + tl.program_id(1) * per_split
    return length, s_lo, tl.minimum(s_lo + per_split, length)


@triton.jit
def _angle_rest(pos, start, offset, inv_freq):
    """[BLOCK_S, HALF] what fl(p f) - fl(p0 f) - fl((p - p0) f) leaves: the reference rounds the product fl(p f),
    the kernel turns keys by (p - p0) f and queries by p0 f; fp32 models add it to first order."""
    return (pos.to(tl.float32)[:, None] * inv_freq[None, :] - (start.to(tl.float32) * inv_freq)[None, :]) \
        - offset.to(tl.float32)[:, None] * inv_freq[None, :]


@triton.jit
def _visibility(mask, b, slots, slot_ok, MASK_KIND: tl.constexpr):
    """(visible, additive) of `slots`: the boolean mask's verdict, and the additive mask's term (0 without one);
    mask: (pointer, batch stride, slot stride)."""
    mask_ptr, mask_sb, mask_ss = mask
    visible = slot_ok
    additive = tl.zeros(slots.shape, tl.float32)
    if MASK_KIND == 1:
        visible = visible & (tl.load(mask_ptr + b * mask_sb + slots * mask_ss, mask=slot_ok, other=0) != 0)
    if MASK_KIND == 2:  # added as the reference adds it: finfo.min stays finite
        additive = tl.load(mask_ptr + b * mask_sb + slots * mask_ss, mask=slot_ok, other=0.0).to(tl.float32)
    return visible, additive


@triton.jit
def _current_key(new_k_ptr, new_k_sb, up_k_ptr, up_k_sr, bias_k_ptr, pos_ptr, pos_sb, inv_freq_ptr, b, h, last,
                 k_lo,
                 HEAD_DIM: tl.constexpr, K_BLOCK_RANK: tl.constexpr, K_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_ROPE: tl.constexpr, DTYPE: tl.constexpr, FAST_MATH: tl.constexpr):
    """This step's key halves [HALF] (fp32), from its exact latent: RoPE(c U + b) at its own position."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)
    col = h * HEAD_DIM + d
    key1 = tl.zeros([HALF], tl.float32)
    key2 = tl.zeros([HALF], tl.float32)
    for c in tl.static_range(0, K_BLOCK_RANK, K_CHUNK):
        rows = k_lo + c + tl.arange(0, K_CHUNK)
        ok = rows < k_lo + K_BLOCK_RANK
        latent = tl.load(new_k_ptr + b * new_k_sb + rows, mask=ok, other=0.0).to(DTYPE).to(tl.float32)[:, None]
        up_at = up_k_ptr + rows[:, None] * up_k_sr + col[None, :]
        key1 += tl.sum(latent * tl.load(up_at, mask=ok[:, None], other=0.0).to(tl.float32), 0)
        key2 += tl.sum(latent * tl.load(up_at + HALF, mask=ok[:, None], other=0.0).to(tl.float32), 0)
    if HAS_BIAS:
        key1 += tl.load(bias_k_ptr + col).to(tl.float32)
        key2 += tl.load(bias_k_ptr + col + HALF).to(tl.float32)
    if HAS_ROPE:
        inv_freq = tl.load(inv_freq_ptr + d).to(tl.float32)
        cos, sin = _trig(_reduce_angle(tl.load(pos_ptr + b * pos_sb + last).to(tl.float32) * inv_freq), FAST_MATH)
        key1, key2 = key1 * cos - key2 * sin, key2 * cos + key1 * sin
    return key1, key2


@triton.jit
def _queries(query_ptr, q_sb, q_sh, b, h, GROUP_HEADS: tl.constexpr, G_PAD: tl.constexpr, HALF: tl.constexpr):
    """The KV head's query heads as columns: halves [HALF, G_PAD] in fp32 (zero columns past GROUP_HEADS). Loaded
    where they are used rather than held across the loop over tiles, whose registers are scarce."""
    g = tl.arange(0, G_PAD)
    q_at = query_ptr + b * q_sb + (h * GROUP_HEADS + g)[None, :] * q_sh + tl.arange(0, HALF)[:, None]
    q1 = tl.load(q_at, mask=(g < GROUP_HEADS)[None, :], other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF, mask=(g < GROUP_HEADS)[None, :], other=0.0).to(tl.float32)
    return q1, q2


@triton.jit
def _turned_queries(query_ptr, q_sb, q_sh, b, h, start, inv_freq_ptr, GROUP_HEADS: tl.constexpr,
                    G_PAD: tl.constexpr, HALF: tl.constexpr, HAS_ROPE: tl.constexpr, FAST_MATH: tl.constexpr):
    """The query columns turned by R(-start) (as they are without RoPE), fp32 [HALF, G_PAD] halves."""
    q1, q2 = _queries(query_ptr, q_sb, q_sh, b, h, GROUP_HEADS, G_PAD, HALF)
    if HAS_ROPE:
        inv_freq = tl.load(inv_freq_ptr + tl.arange(0, HALF)).to(tl.float32)
        cos_q, sin_q = _trig(_reduce_angle(start.to(tl.float32) * inv_freq), FAST_MATH)
        q1, q2 = q1 * cos_q[:, None] + q2 * sin_q[:, None], q2 * cos_q[:, None] - q1 * sin_q[:, None]
    return q1, q2


@triton.jit
def _windowed(pos, query_at, rope_window):
    """Positions as windowed RoPE scores them: one rope_window or more behind the query's is taken as exactly that
    far behind."""
    return tl.where(query_at - pos >= rope_window, query_at - rope_window, pos)


@triton.jit
def _run_start(pos_row, lo, hi, BLOCK_S: tl.constexpr, CHECK: tl.constexpr):
    """(run_lo, first): the tiles of [run_lo, hi) hold consecutive positions up to the last slot's (slot s at
    first + s - run_lo), and run_lo is the first tile boundary from lo where that holds (lo itself in the usual case;
    past the pads at left padding; hi where the last tile does not run on). One pass over the positions, so the
    tiles of the run need neither their positions nor a check of them."""
    offset = tl.load(pos_row + hi - 1, mask=lo < hi, other=0) - (hi - 1)  # a slot of the run holds offset + s
    past = tl.full([CHECK], 0, tl.int32) + lo  # one past the latest slot off the run, per lane
    for s0 in range(lo, hi, CHECK):
        slots = s0 + tl.arange(0, CHECK)
        inside = slots < hi
        found = tl.load(pos_row + slots, mask=inside, other=0)
        past = tl.maximum(past, tl.where(inside & (found != offset + slots), slots + 1, lo))
    run_lo = tl.minimum(lo + tl.cdiv(tl.max(past, 0) - lo, BLOCK_S) * BLOCK_S, hi)
    return run_lo, offset + run_lo


@triton.jit
def _key_scales(k_cache, b, t0, hi, k_lo, k_hi, K_GROUP: tl.constexpr, K_CHUNK: tl.constexpr, EVEN: tl.constexpr,
                K_STORED: tl.constexpr, BLOCK_S: tl.constexpr):
    """The packed key codes' (scales, zero points) of the tile at t0 (slots below hi). The main loop loads them a
    tile ahead: 2-byte loads stay out of the software pipeline, so each tile waited on them."""
    slots = t0 + tl.arange(0, BLOCK_S)
    return packed_scales_at(k_cache, b, slots, slots < hi, k_lo, k_hi, K_GROUP, K_CHUNK, EVEN, K_STORED)


@triton.jit
def _softmax_step(m_i, sums, scores, FAST_MATH: tl.constexpr):
    """Online softmax (base 2) over one more tile: scores [BLOCK_S, G_PAD] against the max [G_PAD] and the sums
    per slot of the tile [BLOCK_S, G_PAD] (added over the slots once, at the end). Returns the new max and sums,
    the old state's factor and p."""
    m_new = tl.maximum(m_i, tl.max(scores, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: keep every weight 0
    alpha = _exp2(m_i - m_use, FAST_MATH)
    p = _exp2(scores - m_use[None, :], FAST_MATH)
    return m_new, sums * alpha[None, :] + p, alpha, p


@triton.jit
def _attend_tile(m_i, sums, acc, t0, pos, start, ordered, cached_lo, cached_hi, length, b, q1r, q2r, cos_delta,
                 sin_delta, inv_freq_ptr, qk_scale, mask, k_cache, k_lo, k_hi, k_order, up1, up2, up_k_ptr, up_k_sr,
                 col, bias1, bias2, k_scale_ahead, k_zero_ahead, far_q, far_row, far_bias, v_cache, v_lo, v_hi, k_desc,
                 v_desc,
                 HALF: tl.constexpr, G_PAD: tl.constexpr,
                 K_BLOCK_RANK: tl.constexpr, K_CHUNK: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                 K_FAST: tl.constexpr, K_EXACT: tl.constexpr, K_CHANNEL: tl.constexpr, K_OUTLIERS: tl.constexpr,
                 K_PACKED: tl.constexpr, K_STORED: tl.constexpr,
                 V_BLOCK_RANK: tl.constexpr, V_CHUNK: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                 V_FAST: tl.constexpr, V_EXACT: tl.constexpr, V_CHANNEL: tl.constexpr, V_OUTLIERS: tl.constexpr,
                 V_PACKED: tl.constexpr, V_STORED: tl.constexpr,
                 HAS_ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr,
                 EXACT_ANGLES: tl.constexpr, FAST_MATH: tl.constexpr, DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 KEY_DTYPE: tl.constexpr, IEEE: tl.constexpr, BLOCK_S: tl.constexpr, FAR: tl.constexpr,
                 VALUES_FIRST: tl.constexpr):
    """One tile of slots t0.. (below cached_hi) into the online softmax state (m_i, sums, acc): keys [BLOCK_S,
    HEAD_DIM] rebuilt on tensor cores (c U + b, two halves), turned by R(δ) (δ the slot's offset from the tile's
    first position `start`), scored as keys @ [q1r; q2r] (R(-start)q, the G_PAD query columns), then acc += pᵀ C_v
    (acc [G_PAD, V_CHUNK]; VALUES_FIRST: acc += C_vᵀ p, acc [V_CHUNK, G_PAD]).
    ordered: the tile's positions are known to be start + δ (else each slot whose position is not turns on by the
    rest of its angle). cached_lo: the first slot it scores (None: t0), the ones before it read but not scored (the
    tile across the window's edge in the near loop). K_EXACT / V_EXACT: the tile may hold exact sink or window copies
    (latent_tile).
    k_scale_ahead, k_zero_ahead: the key codes' scales and zero points, loaded a tile ahead (None: loaded here).
    FAR (windowed RoPE, slots beyond the window): no key is rebuilt; scores = latents @ far_q, the queries turned
    to the window's offset and taken into latent space by the launcher ([K_BLOCK_RANK, G_PAD] at far_row, the
    first chunk of it in registers as far_q), plus far_bias (their product with the key bias).
    k_desc, v_desc: tensor descriptors of 16-bit latents where every slot of the tile is a cached slot of the
    middle range (whole tiles by the tensor memory accelerator, latent_tile; the tile across the window's edge is
    read whole while only its slots below cached_hi are scored), else None."""
    ONE_K_CHUNK: tl.constexpr = K_BLOCK_RANK <= K_CHUNK
    delta = tl.arange(0, BLOCK_S)
    slots = t0 + delta
    slot_ok = slots < cached_hi
    if FAR:
        scores = tl.zeros([BLOCK_S, G_PAD], tl.float32)
    else:
        key1 = tl.zeros([BLOCK_S, HALF], KEY_DTYPE)  # the keys' two halves
        key2 = tl.zeros([BLOCK_S, HALF], KEY_DTYPE)
    for c in range(0, K_BLOCK_RANK, K_CHUNK):  # one chunk for head-wise factors, many for joint ones
        latent = latent_tile(k_cache, b, t0, slots, slot_ok, k_lo + c, k_hi, length, K_BITS, K_GROUP, K_FAST,
                             K_EXACT, K_CHANNEL, K_OUTLIERS, K_CHUNK, BLOCK_S, DTYPE, K_BLOCK_RANK % K_CHUNK == 0,
                             K_PACKED, K_STORED, k_scale_ahead, k_zero_ahead, k_desc)
        if FAR:
            if ONE_K_CHUNK:
                right = far_q
            else:
                rows = c + k_order
                right = tl.load(far_row + rows[:, None] * G_PAD + tl.arange(0, G_PAD)[None, :],
                                mask=(rows < K_BLOCK_RANK)[:, None], other=0.0)
            scores = _mm(latent, right, scores, DOT_DTYPE, IEEE)
        else:
            if ONE_K_CHUNK:
                right1, right2 = up1, up2
            else:
                rows = k_lo + c + k_order
                up_at = up_k_ptr + rows[:, None] * up_k_sr + col[None, :]
                right1 = tl.load(up_at, mask=(rows < k_hi)[:, None], other=0.0)
                right2 = tl.load(up_at + HALF, mask=(rows < k_hi)[:, None], other=0.0)
            key1 = _mm(latent, right1, key1, DOT_DTYPE, IEEE)
            key2 = _mm(latent, right2, key2, DOT_DTYPE, IEEE)
    if FAR:
        if HAS_BIAS:
            scores += far_bias[None, :]
    else:
        if HAS_BIAS:
            key1 += bias1
            key2 += bias2
        if HAS_ROPE:
            key1, key2 = key1 * cos_delta - key2 * sin_delta, key2 * cos_delta + key1 * sin_delta
            offset = pos - start
            if not ordered:
                if tl.max(tl.where(slot_ok, tl.abs(offset - delta), 0), 0) != 0:
                    # positions not consecutive (left padding, edited caches, windowed RoPE): on by (offset - δ) f
                    # per slot
                    freq = tl.load(inv_freq_ptr + tl.arange(0, HALF)).to(tl.float32)
                    cos_t, sin_t = _trig(_reduce_angle((offset - delta).to(tl.float32)[:, None] * freq[None, :]),
                                         FAST_MATH)
                    cos_t, sin_t = cos_t.to(KEY_DTYPE), sin_t.to(KEY_DTYPE)
                    key1, key2 = key1 * cos_t - key2 * sin_t, key2 * cos_t + key1 * sin_t
            if EXACT_ANGLES:
                rest = _angle_rest(pos, start, offset, tl.load(inv_freq_ptr + tl.arange(0, HALF)).to(tl.float32))
                key1, key2 = key1 - rest * key2, key2 + rest * key1
        scores = _mm(key1, q1r, tl.zeros([BLOCK_S, G_PAD], tl.float32), DOT_DTYPE, IEEE)    # [BLOCK_S, G_PAD]
        scores = _mm(key2, q2r, scores, DOT_DTYPE, IEEE)
    seen = slot_ok
    if cached_lo is not None:
        seen = seen & (slots >= cached_lo)
    visible, additive = _visibility(mask, b, slots, seen, MASK_KIND)
    scores = tl.where(visible[:, None], scores * qk_scale + additive[:, None] * LOG2E, float("-inf"))
    m_i, sums, alpha, p = _softmax_step(m_i, sums, scores, FAST_MATH)
    values = latent_tile(v_cache, b, t0, slots, slot_ok, v_lo, v_hi, length, V_BITS, V_GROUP, V_FAST, V_EXACT,
                         V_CHANNEL, V_OUTLIERS, V_CHUNK, BLOCK_S, DTYPE, V_BLOCK_RANK % V_CHUNK == 0, V_PACKED,
                         V_STORED, None,
                         None, v_desc)
    if VALUES_FIRST:
        acc = _mm(tl.trans(values), p, acc * alpha[None, :], DOT_DTYPE, IEEE)
    else:
        acc = _mm(tl.trans(p), values, acc * alpha[:, None], DOT_DTYPE, IEEE)
    return m_i, sums, acc


# the split counts are values, not specializations: the launcher's trial compile (`triton_decode._resident`, which
# reads the registers) passes 2 splits, and a launch of 1 or a multiple of 16 would compile the kernel a second time
@triton.jit(do_not_specialize=["num_splits", "far_splits"])
def latent_decode_kernel(
        query_ptr, q_sb, q_sh,
        k_lat_ptr, k_lat_sb, k_lat_ss, k_lat_sk, k_scale_ptr, k_zero_ptr, k_sz_sb, k_sz_ss, k_sz_sk, k_exact_ptr,
        k_ex_sb, k_ex_ss,
        new_k_ptr, new_k_sb,
        v_lat_ptr, v_lat_sb, v_lat_ss, v_lat_sk, v_scale_ptr, v_zero_ptr, v_sz_sb, v_sz_ss, v_sz_sk, v_exact_ptr,
        v_ex_sb, v_ex_ss,
        new_v_ptr, new_v_sb,
        pos_ptr, pos_sb, up_k_ptr, up_k_sr, bias_k_ptr, inv_freq_ptr, mask_ptr, mask_sb, mask_ss, length_ptr,
        far_ptr, far_bias_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        qk_scale, num_splits, k_width, k_sinks, k_window, v_width, v_sinks, v_window,
        rope_window, k_desc, v_desc,
        start_ptr, far_splits,
        KV_HEADS: tl.constexpr, GROUP_HEADS: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        K_HEADS_PER_BLOCK: tl.constexpr, K_BLOCK_RANK: tl.constexpr, K_CHUNK: tl.constexpr,
        K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_FAST: tl.constexpr, K_EXACT: tl.constexpr,
        K_CHANNEL: tl.constexpr, K_OUTLIERS: tl.constexpr, K_PACKED: tl.constexpr, K_STORED: tl.constexpr,
        V_HEADS_PER_BLOCK: tl.constexpr, V_BLOCK_RANK: tl.constexpr, V_CHUNK: tl.constexpr,
        V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_FAST: tl.constexpr, V_EXACT: tl.constexpr,
        V_CHANNEL: tl.constexpr, V_OUTLIERS: tl.constexpr, V_PACKED: tl.constexpr, V_STORED: tl.constexpr,
        HAS_ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr,
        EXACT_ANGLES: tl.constexpr, FAST_MATH: tl.constexpr, DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
        KEY_DTYPE: tl.constexpr, IEEE: tl.constexpr, WINDOWED: tl.constexpr, VALUES_FIRST: tl.constexpr,
        BLOCK_S: tl.constexpr, POSITIONS_AHEAD: tl.constexpr = False, ACROSS_BOTH: tl.constexpr = False,
        CHECK_BLOCK: tl.constexpr = 1024, FAR: tl.constexpr = False):
    """Partial attention of one (batch row, KV head, split, value chunk): the tiles of the split's slots
    [s_lo, s_hi) through `_attend_tile`, those without exact copies first, except this step's slot (length - 1),
    which the split holding it adds last from new_k / new_v. MASK_KIND 0 none, 1 boolean, 2 additive;
    EXACT_ANGLES: fp32 models (see _angle_rest). WINDOWED (windowed RoPE): a slot rope_window or more positions
    behind this step's scores as if exactly that far: the leading whole tiles of such slots against their latents
    (the queries in latent space, `_attend_tile`'s FAR: made here for head- and group-wise factors, read from
    far_ptr and far_bias_ptr for joint ones), the rest with keys turned to their positions, the far ones among them
    to the window's edge. FAR: the slots before far_end(start_ptr, b) (far_prep_kernel's; all of them far) are
    another kernel's, which wrote its partials to the first far_splits splits of the buffers (`gluon_far.far_kernel`);
    this kernel's splits cover the rest of the row and follow them."""
    pid_bh, v_part = tl.program_id(0), tl.program_id(2)
    # each side of the cache as latent_tiles.latent_tile takes it
    k_cache = (k_lat_ptr, k_lat_sb, k_lat_ss, k_lat_sk, k_scale_ptr, k_zero_ptr, k_sz_sb, k_sz_ss, k_sz_sk,
               k_exact_ptr, k_ex_sb, k_ex_ss, k_width, k_sinks, k_window)
    v_cache = (v_lat_ptr, v_lat_sb, v_lat_ss, v_lat_sk, v_scale_ptr, v_zero_ptr, v_sz_sb, v_sz_ss, v_sz_sk,
               v_exact_ptr, v_ex_sb, v_ex_ss, v_width, v_sinks, v_window)
    mask = (mask_ptr, mask_sb, mask_ss)
    b, h = pid_bh // KV_HEADS, pid_bh % KV_HEADS
    start = 0
    if FAR:  # a multiple of the far loop's 64-slot tile, so of BLOCK_S too (64, or FALLBACK's 16)
        start = far_end(start_ptr, b, KV_HEADS, 64)
    length, s_lo, s_hi = _split_range(length_ptr, num_splits, start, BLOCK_S)
    last = length - 1
    cached_hi = tl.minimum(s_hi, last)
    HALF: tl.constexpr = HEAD_DIM // 2
    ONE_K_CHUNK: tl.constexpr = K_BLOCK_RANK <= K_CHUNK
    d = tl.arange(0, HALF)
    g = tl.arange(0, G_PAD)
    g_ok = g < GROUP_HEADS
    delta = tl.arange(0, BLOCK_S)
    col = h * HEAD_DIM + d
    cos_delta, sin_delta, cos_step, sin_step = 0.0, 0.0, 0.0, 0.0
    if HAS_ROPE:
        inv_freq = tl.load(inv_freq_ptr + d).to(tl.float32)
        cos_delta, sin_delta = _trig(_reduce_angle(delta.to(tl.float32)[:, None] * inv_freq[None, :]), FAST_MATH)
        cos_delta, sin_delta = cos_delta.to(KEY_DTYPE), sin_delta.to(KEY_DTYPE)
        # the turn from one tile's first position to the next one's, in full precision: it is applied once per tile
        cos_step, sin_step = _trig(_reduce_angle(BLOCK_S * inv_freq), False)
    bias1, bias2 = 0.0, 0.0
    if HAS_BIAS:
        bias1 = tl.load(bias_k_ptr + col).to(KEY_DTYPE)[None, :]
        bias2 = tl.load(bias_k_ptr + col + HALF).to(KEY_DTYPE)[None, :]
    k_lo = (h // K_HEADS_PER_BLOCK) * K_BLOCK_RANK
    k_hi = k_lo + K_BLOCK_RANK
    k_order = packed_order(K_CHUNK, K_BITS) if K_PACKED else tl.arange(0, K_CHUNK)  # the latent tiles' channels
    v_order = packed_order(V_CHUNK, V_BITS) if V_PACKED else tl.arange(0, V_CHUNK)
    up1, up2 = 0.0, 0.0  # joint factors: loaded a chunk at a time in each tile
    if ONE_K_CHUNK:  # the KV head's whole block of the factor, once
        rows = k_lo + k_order
        up_at = up_k_ptr + rows[:, None] * up_k_sr + col[None, :]
        up1 = tl.load(up_at, mask=(rows < k_hi)[:, None], other=0.0).to(DOT_DTYPE)
        up2 = tl.load(up_at + HALF, mask=(rows < k_hi)[:, None], other=0.0).to(DOT_DTYPE)
    v_block = (h // V_HEADS_PER_BLOCK) * V_BLOCK_RANK
    v_lo = v_block + v_part * V_CHUNK
    v_hi = v_block + V_BLOCK_RANK
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    sums = tl.zeros([BLOCK_S, G_PAD], tl.float32)
    if VALUES_FIRST:  # the latent context
        acc = tl.zeros([V_CHUNK, G_PAD], tl.float32)
    else:
        acc = tl.zeros([G_PAD, V_CHUNK], tl.float32)
    # tiles [mid_lo, mid_hi) of the split hold no exact sink or window copy; the edge tiles around them may
    low, high = 0, length
    if K_EXACT:
        low, high = tl.maximum(low, k_sinks), tl.minimum(high, length - k_window)
    if V_EXACT:
        low, high = tl.maximum(low, v_sinks), tl.minimum(high, length - v_window)
    mid_lo = tl.minimum(s_lo + tl.cdiv(tl.maximum(low - s_lo, 0), BLOCK_S) * BLOCK_S, cached_hi)
    mid_hi = tl.where(high >= cached_hi, cached_hi, s_lo + tl.maximum(high - s_lo, 0) // BLOCK_S * BLOCK_S)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), cached_hi)  # empty where the split holds no cached slot
    DESCRIPTORS: tl.constexpr = (k_desc is not None) or (v_desc is not None)
    whole_hi = mid_hi  # the far tiles, read whole and unmasked from k_desc, v_desc, end here or before
    if DESCRIPTORS:
        whole_hi = mid_lo + (mid_hi - mid_lo) // BLOCK_S * BLOCK_S
    pos_row = pos_ptr + b * pos_sb
    # windowed RoPE: the slots far from this step's position, guessed from the last position of the middle range
    # (pos[mid_hi - 1]) as if the positions ran on from mid_lo, need no scan: [mid_lo, spec_hi) in whole tiles (the
    # whole middle range of every split but those reaching into the window, which stop at the tile across its edge).
    # The far loop below checks their positions as it reads them
    query_at, spec_hi = 0, mid_lo
    if WINDOWED:
        query_at = tl.load(pos_row + last)
        guessed = mid_hi - mid_lo - (rope_window - (query_at - tl.load(pos_row + mid_hi - 1, mask=mid_lo < mid_hi,
                                                                       other=0)))
        spec_hi = tl.where(guessed >= mid_hi - mid_lo, mid_hi, mid_lo + tl.maximum(guessed, 0) // BLOCK_S * BLOCK_S)
    # the middle tiles from run_lo on hold consecutive positions (all of them in the usual case, those after the pads
    # at left padding): no tile there loads its positions, and the queries turn from one tile's first position to
    # the next by R(-BLOCK_S) (an fp32 product per tile, not a sine per frequency); the tiles before run_lo (those
    # from spec_hi, windowed) go with the edge tiles, each loading its positions and turning the queries by its own
    # first one. Where spec_hi = mid_hi the scan is empty and `first` means nothing: rebuild_lo is mid_hi either way
    run_lo, first = mid_lo, 0  # without RoPE the positions are not read
    if HAS_ROPE:
        run_lo, first = _run_start(pos_row, spec_hi, mid_hi, BLOCK_S, CHECK_BLOCK)
    AHEAD: tl.constexpr = K_PACKED and ONE_K_CHUNK  # the key codes' scales loaded a tile ahead
    K_EVEN: tl.constexpr = K_BLOCK_RANK % K_CHUNK == 0
    # windowed RoPE: the leading whole tiles of the run of slots at least rope_window positions behind this step's
    # score in latent space; the queries' positions differ only at left padding
    rebuild_lo, far_lo, far_q, far_bias = run_lo, run_lo, 0.0, 0.0
    far_row = far_ptr + pid_bh * K_BLOCK_RANK * G_PAD
    if WINDOWED:
        count = query_at - rope_window - first + 1  # slots from run_lo on whose positions are far
        rebuild_lo = tl.where(count >= mid_hi - run_lo, mid_hi, run_lo + tl.maximum(count, 0) // BLOCK_S * BLOCK_S)
        if ONE_K_CHUNK:  # B_k's block of the KV head times R(rope_window - p) q, here (joint: the launcher's)
            far1, far2 = _turned_queries(query_ptr, q_sb, q_sh, b, h, query_at - rope_window, inv_freq_ptr,
                                         GROUP_HEADS, G_PAD, HALF, HAS_ROPE, FAST_MATH)
            far_q = _mm(up1, far1, tl.zeros([K_CHUNK, G_PAD], tl.float32), DOT_DTYPE, IEEE)
            far_q = _mm(up2, far2, far_q, DOT_DTYPE, IEEE).to(DOT_DTYPE)
            if HAS_BIAS:
                far_bias = tl.sum(far1 * tl.load(bias_k_ptr + col).to(tl.float32)[:, None], 0) \
                    + tl.sum(far2 * tl.load(bias_k_ptr + col + HALF).to(tl.float32)[:, None], 0)
        elif HAS_BIAS:
            far_bias = tl.load(far_bias_ptr + pid_bh * G_PAD + g)
        # the far tiles: from mid_lo where the run starts at spec_hi (the usual case), else from run_lo (the tiles
        # before it go with the edge tiles)
        far_lo = tl.where(run_lo == spec_hi, mid_lo, run_lo)
    # windowed RoPE: the tile across the window's edge (far slots from rebuild_lo, near ones from near_slot) goes
    # through both loops where it is whole (ACROSS_BOTH), the far loop scoring its far slots and the near loop the
    # others, else with the edge tiles below, which turn each far slot to the edge (H100, 16K, batch 16, a step whose
    # edge falls inside a tile: keep 0.25 w1024 0.1098 -> 0.1083 ms on the Llama-3-8B shape, budget w1024 0.249 ->
    # 0.246, Llama-2-7B budget w1024 0.995 -> 0.977); every slot from near_lo on is near
    near_lo, near_seen = rebuild_lo, None
    if WINDOWED:
        across = (rebuild_lo < mid_hi) & (query_at - (first + (rebuild_lo - run_lo)) >= rope_window)
        if ACROSS_BOTH:
            near_slot = tl.minimum(run_lo + tl.maximum(count, 0), mid_hi)
            both = across & (rebuild_lo + BLOCK_S <= whole_hi)
            near_lo = tl.where(across & ~both, rebuild_lo + BLOCK_S, rebuild_lo)
            near_seen = tl.where(both, near_slot, near_lo)
        else:
            near_lo = tl.where(across, rebuild_lo + BLOCK_S, rebuild_lo)  # past mid_hi where that tile is the last
    # the edge loop's last tiles: [tail_lo, cached_hi). With descriptors, a last tile that is not whole goes with the
    # near tiles where its positions run on and are near (their loop masks it; it had taken the edge loop's sine per
    # slot: keep 0.25 w1024 0.1084 -> 0.1075 ms on the Llama-3-8B shape, 16K, batch 16, H100), else with the edge
    # tiles: as the tile across the window's edge, or from tail_lo where it is far or off the run (run_lo = mid_hi:
    # the first part of the edge loop then stops at whole_hi, so that it does not take the tile twice)
    tail_lo = mid_hi
    if DESCRIPTORS:
        tail_lo = tl.where(rebuild_lo > whole_hi, whole_hi, mid_hi)
        rebuild_lo = tl.minimum(rebuild_lo, whole_hi)
        far_lo = tl.minimum(far_lo, whole_hi)
    far_hi, far_seen = rebuild_lo, rebuild_lo  # the far loop's tiles end at far_hi, the slots it scores at far_seen
    if WINDOWED and ACROSS_BOTH:
        far_hi = tl.where(both, rebuild_lo + BLOCK_S, rebuild_lo)
        far_seen = tl.where(both, near_slot, rebuild_lo)
    # two phases: the run's tiles from near_lo (keys rebuilt) and windowed RoPE's far tiles. NEAR_FIRST (16-bit
    # latents): the near tiles first, so that the splits holding the window rebuild its keys while the others
    # stream far tiles, rather than at the end, when nothing else keeps the memory busy (H100, 16K, batch 16:
    # keep 0.25 w1024 0.1116 -> 0.1077 ms on the Llama-3-8B shape); the budget plan's codes lost with it (0.244
    # -> 0.249 ms). A far check that fails (below) sends the near tiles to the edge loop too
    NEAR_FIRST: tl.constexpr = WINDOWED and K_BITS == 16 and V_BITS == 16
    for phase in tl.static_range(2):
        if (phase == 0) == NEAR_FIRST:
            # the run's tiles from near_lo, keys rebuilt: consecutive positions, so the queries turn from one
            # tile's first position to the next by R(-BLOCK_S), and the loop holds no branch on positions
            qr1, qr2 = _turned_queries(query_ptr, q_sb, q_sh, b, h, first + (near_lo - run_lo), inv_freq_ptr,
                                       GROUP_HEADS, G_PAD, HALF, HAS_ROPE, FAST_MATH)
            k_scale, k_zero = None, None  # else each tile loads them itself
            if AHEAD:
                k_scale, k_zero = _key_scales(k_cache, b, near_lo, mid_hi, k_lo, k_hi, K_GROUP, K_CHUNK, K_EVEN,
                                              K_STORED, BLOCK_S)
            for t0 in range(near_lo, mid_hi, BLOCK_S):
                next_scale, next_zero = None, None
                if AHEAD:
                    next_scale, next_zero = _key_scales(k_cache, b, t0 + BLOCK_S, mid_hi, k_lo, k_hi, K_GROUP,
                                                        K_CHUNK, K_EVEN, K_STORED, BLOCK_S)
                start = first + (t0 - run_lo)
                pos = start + delta
                turned1, turned2 = qr1, qr2
                if EXACT_ANGLES and HAS_ROPE:  # fp32 models: each tile's own angle, as the reference rounds it
                    turned1, turned2 = _turned_queries(query_ptr, q_sb, q_sh, b, h, start, inv_freq_ptr,
                                                       GROUP_HEADS, G_PAD, HALF, HAS_ROPE, FAST_MATH)
                m_i, sums, acc = _attend_tile(
                    m_i, sums, acc, t0, pos, start, True, near_seen, mid_hi, length, b, turned1.to(DOT_DTYPE),
                    turned2.to(DOT_DTYPE), cos_delta, sin_delta, inv_freq_ptr, qk_scale, mask, k_cache, k_lo, k_hi,
                    k_order, up1, up2, up_k_ptr, up_k_sr, col, bias1, bias2, k_scale, k_zero, 0.0, far_row, 0.0,
                    v_cache, v_lo, v_hi, None, None, HALF, G_PAD,
                    K_BLOCK_RANK, K_CHUNK, K_BITS, K_GROUP, K_FAST, False, K_CHANNEL, K_OUTLIERS, K_PACKED, K_STORED,
                    V_BLOCK_RANK, V_CHUNK, V_BITS, V_GROUP, V_FAST, False, V_CHANNEL, V_OUTLIERS, V_PACKED, V_STORED,
                    HAS_ROPE, HAS_BIAS, MASK_KIND, EXACT_ANGLES, FAST_MATH, DTYPE, DOT_DTYPE, KEY_DTYPE, IEEE,
                    BLOCK_S, False, VALUES_FIRST)
                if HAS_ROPE:
                    qr1, qr2 = (qr1 * cos_step[:, None] + qr2 * sin_step[:, None],
                                qr2 * cos_step[:, None] - qr1 * sin_step[:, None])
                k_scale, k_zero = next_scale, next_zero
        elif WINDOWED:  # the far tiles
            floor = query_at - rope_window  # the latest position that is far
            latest = tl.zeros([BLOCK_S], tl.int32) + floor  # the latest position read, per lane
            k_scale, k_zero = None, None
            if AHEAD:
                k_scale, k_zero = _key_scales(k_cache, b, far_lo, far_seen, k_lo, k_hi, K_GROUP, K_CHUNK, K_EVEN,
                                              K_STORED, BLOCK_S)
            if POSITIONS_AHEAD:
                pos_next = tl.load(pos_row + far_lo + delta, mask=far_lo + delta < far_seen, other=floor)
            for t0 in range(far_lo, far_hi, BLOCK_S):
                if POSITIONS_AHEAD:  # the next tile's positions, so that the check below waits on no load
                    pos_here = pos_next
                    pos_next = tl.load(pos_row + t0 + BLOCK_S + delta, mask=t0 + BLOCK_S + delta < far_seen,
                                       other=floor)
                next_scale, next_zero = None, None
                if AHEAD:
                    next_scale, next_zero = _key_scales(k_cache, b, t0 + BLOCK_S, far_seen, k_lo, k_hi, K_GROUP,
                                                        K_CHUNK, K_EVEN, K_STORED, BLOCK_S)
                m_i, sums, acc = _attend_tile(
                    m_i, sums, acc, t0, 0, 0, True, None, far_seen, length, b, 0.0, 0.0, 0.0, 0.0, inv_freq_ptr,
                    qk_scale, mask, k_cache, k_lo, k_hi, k_order, up1, up2, up_k_ptr, up_k_sr, col, bias1, bias2,
                    k_scale, k_zero, far_q, far_row, far_bias, v_cache, v_lo, v_hi, k_desc, v_desc, HALF, G_PAD,
                    K_BLOCK_RANK, K_CHUNK, K_BITS, K_GROUP, K_FAST, False, K_CHANNEL, K_OUTLIERS, K_PACKED, K_STORED,
                    V_BLOCK_RANK, V_CHUNK, V_BITS, V_GROUP, V_FAST, False, V_CHANNEL, V_OUTLIERS, V_PACKED, V_STORED,
                    HAS_ROPE, HAS_BIAS, MASK_KIND, EXACT_ANGLES, FAST_MATH, DTYPE, DOT_DTYPE, KEY_DTYPE, IEEE,
                    BLOCK_S, True, VALUES_FIRST)
                if not POSITIONS_AHEAD:
                    pos_here = tl.load(pos_row + t0 + delta, mask=t0 + delta < far_seen, other=floor)
                latest = tl.maximum(latest, pos_here)
                k_scale, k_zero = next_scale, next_zero
            if tl.max(latest, 0) > floor:
                # a slot taken as far is not (positions that do not run on): every tile of the split, the near ones
                # included, goes with the edge tiles, which read each slot's position
                m_i = tl.full([G_PAD], float("-inf"), tl.float32)
                sums = tl.zeros([BLOCK_S, G_PAD], tl.float32)
                acc = tl.zeros(acc.shape, tl.float32)
                far_lo, rebuild_lo, near_lo, tail_lo = mid_hi, mid_hi, mid_hi, mid_hi
    # the other tiles, each with its own positions and queries turned by its first one: [s_lo, far_lo) (the edge
    # tiles that may hold exact sink copies, then those before the run: at left padding, the pads' tiles; after the
    # far loop's check failed, every tile up to mid_hi), the tile across the window's edge [rebuild_lo, near_lo),
    # and [tail_lo, cached_hi) (those that may hold window copies; with descriptors, a last tile not whole that is
    # far or off the run)
    first_edge = tl.cdiv(tl.maximum(far_lo - s_lo, 0), BLOCK_S)  # far_lo is a tile boundary, or mid_hi = cached_hi
    across_edge = first_edge + (near_lo - rebuild_lo) // BLOCK_S
    for tile in range(0, across_edge + tl.cdiv(cached_hi - tail_lo, BLOCK_S)):
        t0 = tl.where(tile < first_edge, s_lo + tile * BLOCK_S,
                      tl.where(tile < across_edge, rebuild_lo, tail_lo + (tile - across_edge) * BLOCK_S))
        start = tl.load(pos_row + t0)
        pos = tl.load(pos_row + t0 + delta, mask=t0 + delta < cached_hi, other=0)
        if WINDOWED:
            pos = _windowed(pos, query_at, rope_window)
            start = _windowed(start, query_at, rope_window)
        qr1, qr2 = _turned_queries(query_ptr, q_sb, q_sh, b, h, start, inv_freq_ptr, GROUP_HEADS, G_PAD, HALF,
                                   HAS_ROPE, FAST_MATH)
        m_i, sums, acc = _attend_tile(
            m_i, sums, acc, t0, pos, start, False, None, cached_hi, length, b, qr1.to(DOT_DTYPE), qr2.to(DOT_DTYPE),
            cos_delta, sin_delta, inv_freq_ptr, qk_scale, mask, k_cache, k_lo, k_hi, k_order, up1, up2, up_k_ptr,
            up_k_sr, col, bias1, bias2, None, None, 0.0, far_row, 0.0, v_cache, v_lo, v_hi, None, None, HALF, G_PAD,
            K_BLOCK_RANK, K_CHUNK, K_BITS, K_GROUP, K_FAST, K_EXACT, K_CHANNEL, K_OUTLIERS, K_PACKED, K_STORED,
            V_BLOCK_RANK, V_CHUNK, V_BITS, V_GROUP, V_FAST, V_EXACT, V_CHANNEL, V_OUTLIERS, V_PACKED, V_STORED,
            HAS_ROPE, HAS_BIAS, MASK_KIND, EXACT_ANGLES, FAST_MATH, DTYPE, DOT_DTYPE, KEY_DTYPE, IEEE, BLOCK_S,
            False, VALUES_FIRST)
    l_i = tl.sum(sums, 0)
    if (last >= s_lo) & (last < s_hi):  # this step's token, from its exact latents
        key1, key2 = _current_key(new_k_ptr, new_k_sb, up_k_ptr, up_k_sr, bias_k_ptr, pos_ptr, pos_sb,
                                  inv_freq_ptr, b, h, last, k_lo, HEAD_DIM, K_BLOCK_RANK, K_CHUNK, HAS_BIAS, HAS_ROPE,
                                  DTYPE, FAST_MATH)
        q1, q2 = _queries(query_ptr, q_sb, q_sh, b, h, GROUP_HEADS, G_PAD, HALF)
        visible, additive = _visibility(mask, b, last + delta, delta == 0, MASK_KIND)
        score = tl.sum(q1 * key1[:, None] + q2 * key2[:, None], 0) * qk_scale \
            + tl.sum(tl.where(delta == 0, additive, 0.0), 0) * LOG2E
        score = tl.where(tl.sum(visible.to(tl.int32), 0) > 0, score, float("-inf"))          # [G_PAD]
        m_new = tl.maximum(m_i, score)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _exp2(m_i - m_use, FAST_MATH)
        p = _exp2(score - m_use, FAST_MATH)
        l_i = l_i * alpha + p
        m_i = m_new
        ch = v_lo + v_order
        value = tl.load(new_v_ptr + b * new_v_sb + ch, mask=ch < v_hi, other=0.0).to(DTYPE).to(tl.float32)
        if VALUES_FIRST:
            acc = acc * alpha[None, :] + value[:, None] * p[None, :]
        else:
            acc = acc * alpha[:, None] + p[:, None] * value[None, :]
    if FAR:
        row = (pid_bh * (far_splits + num_splits) + far_splits + tl.program_id(1)) * GROUP_HEADS + g  # [G_PAD]
    else:
        row = (pid_bh * num_splits + tl.program_id(1)) * GROUP_HEADS + g
    ch = v_part * V_CHUNK + v_order
    if VALUES_FIRST:
        tl.store(part_acc_ptr + row[None, :] * V_BLOCK_RANK + ch[:, None], acc,
                 mask=g_ok[None, :] & (ch < V_BLOCK_RANK)[:, None])
    else:
        tl.store(part_acc_ptr + row[:, None] * V_BLOCK_RANK + ch[None, :], acc,
                 mask=g_ok[:, None] & (ch < V_BLOCK_RANK)[None, :])
    if v_part == 0:
        tl.store(part_max_ptr + row, m_i, mask=g_ok)
        tl.store(part_sum_ptr + row, l_i, mask=g_ok)


@triton.jit
def far_prep_kernel(query_ptr, q_sb, q_sh, rows_ptr, inv_freq_ptr, pos_ptr, pos_sb, length_ptr, out_ptr, first_ptr,
                    exact_window, rope_window, qk_scale, KV_HEADS: tl.constexpr, GROUP_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, RANK: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """What the Gluon far loop (`gluon_far.far_kernel`) needs of a decode step, per (batch row b, KV head h) =
    program_id(0), in two programs that do not wait on each other (program_id(1)):
    0: the latent queries of h's query heads as windowed RoPE scores far slots, qk_scale R(window - p) q through h's
    rows of B_k (rows_ptr: float32 [kv_heads, RANK, HEAD_DIM], ranks already in the far loop's order,
    `triton_decode.far_rows`; p this step's position), float16 out_ptr [rows * kv_heads, 8, RANK], zero columns past
    the query heads;
    1: first_ptr[b * kv_heads + h]: the first slot of h's share of [0, end) whose position is less than rope_window
    behind this step's (end if none), end the last multiple of TILE at most length - exact_window. The far loop's
    slots of row b end at the least of its KV heads' firsts, rounded down to a multiple of TILE (`far_end`).
    Each waits on a short chain of dependent loads (the length, then this step's position, on which the queries'
    angles and the scan's positions depend): one program for both took 7-8 us a layer on an H200, mostly waiting."""
    pid = tl.program_id(0)
    b, h = pid // KV_HEADS, pid % KV_HEADS
    length = tl.load(length_ptr).to(tl.int32)
    row = pos_ptr + b * pos_sb
    at = tl.load(row + length - 1)
    if tl.program_id(1) == 0:
        HALF: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HALF)
        r = tl.arange(0, RANK)
        rows = rows_ptr + (h * RANK + r)[:, None] * HEAD_DIM + d[None, :]
        rows1 = tl.load(rows)
        rows2 = tl.load(rows + HALF)
        angle = (rope_window - at).to(tl.float32) * tl.load(inv_freq_ptr + d).to(tl.float32)
        cos, sin = tl.cos(angle), tl.sin(angle)
        for g in tl.static_range(8):
            latent = tl.zeros([RANK], tl.float32)
            if g < GROUP_HEADS:
                q_at = query_ptr + b * q_sb + (h * GROUP_HEADS + g) * q_sh + d
                q1 = tl.load(q_at).to(tl.float32)
                q2 = tl.load(q_at + HALF).to(tl.float32)
                turned1, turned2 = q1 * cos - q2 * sin, q2 * cos + q1 * sin
                latent = (tl.sum(rows1 * turned1[None, :], 1) + tl.sum(rows2 * turned2[None, :], 1)) * qk_scale
            tl.store(out_ptr + (pid * 8 + g) * RANK + r, latent.to(tl.float16))
    else:
        limit = at - rope_window
        end = tl.maximum(length - exact_window, 0) // TILE * TILE
        share = tl.cdiv(end, KV_HEADS)
        lo = h * share
        hi = tl.minimum(lo + share, end)
        first = tl.full([BLOCK], 0, tl.int32) + end
        for s0 in range(lo, hi, BLOCK):
            slots = s0 + tl.arange(0, BLOCK)
            inside = slots < hi
            near = inside & (tl.load(row + slots, mask=inside, other=0) > limit)
            first = tl.minimum(first, tl.where(near, slots, end))
        tl.store(first_ptr + pid, tl.min(first, 0))


@triton.jit
def far_end(first_ptr, b, KV_HEADS: tl.constexpr, TILE: tl.constexpr):
    """Where the far loop's slots of batch row b end: far_prep_kernel's firsts of its KV heads (at most 64), least,
    rounded down to a multiple of TILE."""
    heads = tl.arange(0, 64)
    firsts = tl.load(first_ptr + b * KV_HEADS + heads, mask=heads < KV_HEADS, other=2 ** 30)
    return tl.min(firsts, 0) // TILE * TILE


@triton.jit
def combine_splits_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_splits,
                          GROUP_HEADS: tl.constexpr, RANGE: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          CHUNK: tl.constexpr):
    """context [batch*heads, RANGE] fp32 = sum over splits of acc 2^(m - M) / sum of l 2^(m - M) (maxima in base 2);
    0 where no slot was visible."""
    head_row, part = tl.program_id(0), tl.program_id(1)
    pid_bh, g = head_row // GROUP_HEADS, head_row % GROUP_HEADS
    split = tl.arange(0, SPLITS_PAD)
    split_ok = split < num_splits
    rows = (pid_bh * num_splits + split) * GROUP_HEADS + g
    maxima = tl.load(part_max_ptr + rows, mask=split_ok, other=float("-inf"))
    top = tl.max(maxima, 0)
    weights = tl.math.exp2(maxima - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(tl.load(part_sum_ptr + rows, mask=split_ok, other=0.0) * weights, 0)
    ch = part * CHUNK + tl.arange(0, CHUNK)
    acc = tl.load(part_acc_ptr + rows[:, None] * RANGE + ch[None, :], mask=split_ok[:, None] & (ch < RANGE)[None, :],
                  other=0.0)
    context = tl.sum(acc * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + head_row * RANGE + ch, context, mask=ch < RANGE)


@triton.jit
def combine_project_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, up_ptr, bias_ptr, out_ptr, num_splits,
                           KV_HEADS: tl.constexpr, GROUP_HEADS: tl.constexpr, G_POW2: tl.constexpr,
                           SPLITS_PAD: tl.constexpr, RANGE: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                           D_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """combine_splits_kernel and the value up-projection in one launch, per (batch row, KV head) and block of D_BLOCK
    output channels: its query heads' latent contexts (sum over splits of acc 2^(m - M) / sum of l 2^(m - M), 0
    where no slot was visible), a CHUNK of channels at a time, times the KV head's rows of B_v (up_ptr: float32
    [kv_heads, RANGE, HEAD_DIM]), plus b_v (bias_ptr in the model's dtype, read as float32); out [batch, heads,
    HEAD_DIM] in its own dtype. Every split of a chunk is loaded at once, [SPLITS_PAD, G_POW2, CHUNK], and the
    chunks are unrolled, so the loads do not wait on one another (a loop over the splits waited on each: 18 us a
    layer where this takes a few); float32 products on the CUDA cores, as the reference projects the float32
    context."""
    pid_bh, d_part = tl.program_id(0), tl.program_id(1)
    h = pid_bh % KV_HEADS
    split = tl.arange(0, SPLITS_PAD)
    g = tl.arange(0, G_POW2)
    ok = (split < num_splits)[:, None] & (g < GROUP_HEADS)[None, :]
    rows = (pid_bh * num_splits + split)[:, None] * GROUP_HEADS + g[None, :]  # [SPLITS_PAD, G_POW2]
    maxima = tl.load(part_max_ptr + rows, mask=ok, other=float("-inf"))
    top = tl.max(maxima, 0)
    weights = tl.math.exp2(maxima - tl.where(top == float("-inf"), 0.0, top)[None, :])
    total = tl.sum(tl.load(part_sum_ptr + rows, mask=ok, other=0.0) * weights, 0)
    weights = weights / tl.where(total > 0, total, 1.0)[None, :]
    d = d_part * D_BLOCK + tl.arange(0, D_BLOCK)
    out = tl.zeros([G_POW2, D_BLOCK], tl.float32)
    for c in tl.static_range(0, RANGE, CHUNK):
        ch = c + tl.arange(0, CHUNK)
        ch_ok = ch < RANGE
        acc = tl.load(part_acc_ptr + rows[:, :, None] * RANGE + ch[None, None, :],
                      mask=ok[:, :, None] & ch_ok[None, None, :], other=0.0)  # [SPLITS_PAD, G_POW2, CHUNK]
        context = tl.sum(acc * weights[:, :, None], 0)  # [G_POW2, CHUNK]
        up = tl.load(up_ptr + (h * RANGE + ch)[:, None] * HEAD_DIM + d[None, :], mask=ch_ok[:, None], other=0.0)
        out += tl.sum(context[:, :, None] * up[None, :, :], 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + h * HEAD_DIM + d).to(tl.float32)[None, :]
    head_row = pid_bh * GROUP_HEADS + g
    tl.store(out_ptr + head_row[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < GROUP_HEADS)[:, None])
