"""Gluon (Triton's layout-explicit dialect) far loop of the budget-0.2 plan's decode attention: the `@gluon.jit` code
only (its launch is `lowering/gluon_far.py`'s). The decode launcher (`triton_decode.decode_attention_with`) hands it a
step's far slots (windowed RoPE) where the cache holds this layout, and the Triton kernel the rest; checked against
the dequantized cache (`tests/test_gluon_far.py`) and in the decode step against the reference op
(`tests/test_kernels.py`) on a GPU, timed by `benchmarks/far_loop.py` (docs/gpu-notes.md). Triton's interpreter does
not run Gluon kernels: on CPU the launcher's path is tested with its torch stand-in
(`gluon_far.reference_far_splits`), and the kernel is compiled for sm_90.

The latents it reads: per KV head, 64 key channels of 4-bit codes and 128 value channels of 3-bit codes (in
`quantize.three_bit_order`), groups of 32 channels with a float16 scale and zero point per token, the cache's
layout (`lowering/quantize.py`). It scores every slot of a split against the latent queries (the query heads of the
KV head, already taken through the key factors, turned to the windowed position and scaled for base 2) and keeps
per split the partial (max, sum, latent context) the decode kernel's combine reduces.

One warp per program owns its slots from codes to context: no shared memory and no barrier. Per 16 slots, transposed
mma.sync products (m16n8k16): scoresT [16 slots, 8 columns] = K [16 slots, 64 ranks] @ qT [64, 8] and ctxT [128
channels, 8] += VT [128 channels, 16 slots] @ pT [16 slots, 8]; four such groups per iteration share one
online-softmax update, their values dequantized after it, each just before its product (fewer registers live across
the softmax: 134 against 158). The codes load straight into the operands' registers: lane (g, t) loads int32 words 2t
and 2t + 1 of the key codes of slots g and g + 8, and the 48 bits of value codes of channels 16g .. 16g + 15 of slots
2t, 2t + 1, 2t + 8 and 2t + 9; PTX turns them into float16 two at a time (a key word's codes i and i + 4, one value
channel of two slots), and joins, a reshape and a permute give the operands' layouts, which convert_layout asserts
need no data movement. So the operands' ranks and channels are permuted: `key_rank_channels` and `value_channels` say
which cache channel each holds; the queries come permuted, the context is stored in the cache's order.
"""
import struct

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


def _half2(value: float) -> str:
    """A float16 constant twice over, as a PTX .b32 immediate."""
    bits = struct.unpack("<H", struct.pack("<e", value))[0]
    return f"0x{bits:04x}{bits:04x}"


def _pairs_asm(pairs, shifts, bits, scale_at, zero_at, prologue) -> str:
    """PTX turning codes into float16 latents two at a time. Output pair k (outputs 2k and 2k + 1, the low and high
    halves of a register) takes its codes at bit shifts[k] of each 16-bit half of a register: pairs[k] = (selector,
    x, y) gathers it by prmt from registers x and y, or (None, x, None) takes register x as it is. lop3 masks the
    code into the mantissa of 1024, an exact fma takes 1024 away and divides by 2^shift, a last fma applies the
    (scale, zero point) pairs: inputs scale_at and zero_at (counted from the first input), a float16 each."""
    outputs = 2 * len(shifts)
    lines = [f"mov.b32 s2, {{${outputs + scale_at[0]}, ${outputs + scale_at[1]}}};",
             f"mov.b32 z2, {{${outputs + zero_at[0]}, ${outputs + zero_at[1]}}};", *prologue]
    for shift in sorted(set(shifts)):  # f16x2 operands are registers
        lines.append(f"mov.b32 m{shift}, {_half2(2.0 ** -shift)};")
        lines.append(f"mov.b32 a{shift}, {_half2(-1024.0 * 2.0 ** -shift)};")
    gathered = None
    for k, ((selector, x, y), shift) in enumerate(zip(pairs, shifts)):
        source = x
        if selector is not None:
            source = "w"
            if (selector, x, y) != gathered:
                lines.append(f"prmt.b32 w, {x}, {y}, {selector:#06x};")
                gathered = (selector, x, y)
        mask = ((1 << bits) - 1) << shift
        lines.append(f"lop3.b32 t, {source}, {mask | mask << 16:#010x}, 0x64006400, 0xea;")
        lines.append(f"fma.rn.f16x2 t, t, m{shift}, a{shift};")
        lines.append("fma.rn.f16x2 t, t, s2, z2;")
        lines.append(f"mov.b32 {{${2 * k}, ${2 * k + 1}}}, t;")
    names = ", ".join(f"m{shift}, a{shift}" for shift in sorted(set(shifts)))
    return "{\n.reg .b32 s2, z2, t, w, x0, x1, y0, y1, " + names + ";\n" + "\n".join(lines) + "\n}"


def _key_asm() -> str:
    """Inputs $8 (an int32 word of 8 4-bit codes, code k at bits 4k), $9 scale, $10 zero point. Outputs: codes 0, 4,
    1, 5, 2, 6, 3, 7 (pairs (i, i + 4) lie at bits 4i and 4i + 16: of the word, then of the word shifted by 8)."""
    pairs = [(None, "$8", None)] * 2 + [(None, "y0", None)] * 2
    return _pairs_asm(pairs, [0, 4, 0, 4], 4, (1, 1), (2, 2), ["shr.u32 y0, $8, 8;"])


def _value_asm() -> str:
    """Inputs $32 $33 (two int32 words of slot A holding its 48 bits of codes from bit $36, 0 or 16), $34 $35 (slot
    B's), $36, $37 $38 (the scales of A and B), $39 $40 (their zero points). Output pair 8X + i holds code i of
    3-byte word X (of the 48 bits) of slot A, then of slot B."""
    prologue = ["shf.r.wrap.b32 x0, $32, $33, $36;", "shr.u32 y0, $33, $36;",  # A's 48 bits: x0, then y0
                "shf.r.wrap.b32 x1, x0, y0, 24;",                              # A's word 1 at bit 0 of x1
                "shf.r.wrap.b32 y1, $34, $35, $36;", "shr.u32 w, $35, $36;",    # B's 48 bits: y1, then w
                "shf.r.wrap.b32 w, y1, w, 24;", "mov.b32 y0, w;"]              # B's word 1 in y0 (prmt takes w)
    pairs, shifts = [], []
    for a, b in (("x0", "y1"), ("x1", "y0")):
        for i in range(8):
            byte, shift = divmod(3 * i, 8)
            pairs.append((byte | (byte + 1) << 4 | (4 + byte) << 8 | (5 + byte) << 12, a, b))
            shifts.append(shift)
    return _pairs_asm(pairs, shifts, 3, (5, 6), (7, 8), prologue)


KEY_ASM = gl.constexpr(_key_asm())
VALUE_ASM = gl.constexpr(_value_asm())
KEY_CONSTRAINTS = gl.constexpr("=h," * 8 + "r,h,h")
VALUE_CONSTRAINTS = gl.constexpr("=h," * 32 + "r,r,r,r,r,h,h,h,h")

# layouts of one warp: the products' accumulator and operands
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
# key words [8 slots, 8 words]: lane (g, t) holds words 2t and 2t + 1 of slot g
KEY_WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[],
    shape=[8, 8]))
HEADS = gl.constexpr(gl.BlockedLayout(size_per_thread=[2], threads_per_warp=[32], warps_per_cta=[1], order=[0]))
# [8, 4]: element (g, t) in lane (g, t)
LANES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[8, 4]))


@gluon.jit
def _ex2(x):
    """2^x: the multi-function unit's approximation, flushing results below 2^-126 to 0."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _masked(scores, mask_row, s0, slot, mask_ss: gl.constexpr):
    """Scores [16 slots, 8] of the slots from s0, -inf where the boolean mask is false."""
    keep = gl.load(mask_row + (s0 + slot) * mask_ss)
    return gl.where(keep[:, None], scores, -float("inf"))


@gluon.jit
def _finite(maxima):
    """Running maxima with -inf (no slot seen) taken as 0, so that 2^(score - max) is 0, not NaN."""
    return gl.where(maxima == -float("inf"), 0.0, maxima)


@gluon.jit
def _load(rows, s0, offsets, kw_ss: gl.constexpr, ks_ss: gl.constexpr, vw_ss: gl.constexpr, vs_ss: gl.constexpr):
    """The raw words, scales and zero points of the 16 slots from s0, in the layouts _keys and _values take them.
    Keys: two halves of 8 slots (rows g and g + 8)."""
    kw_row, ks_row, kz_row, vw_row, vs_row, vz_row = rows
    k_off, ks_off, v_off, vs_off = offsets
    kbase = kw_row + s0 * kw_ss
    sbase = s0 * ks_ss
    w_lo = gl.load(kbase + k_off)
    w_hi = gl.load(kbase + 8 * kw_ss + k_off)
    s_lo = gl.load(ks_row + sbase + ks_off)
    z_lo = gl.load(kz_row + sbase + ks_off)
    s_hi = gl.load(ks_row + sbase + 8 * ks_ss + ks_off)
    z_hi = gl.load(kz_row + sbase + 8 * ks_ss + ks_off)
    # values: slot pairs (2t, 2t + 1) and (2t + 8, 2t + 9)
    vbase = vw_row + s0 * vw_ss
    a0 = gl.load(vbase + v_off)
    a1 = gl.load(vbase + v_off + 4)
    b0 = gl.load(vbase + vw_ss + v_off)
    b1 = gl.load(vbase + vw_ss + v_off + 4)
    c0 = gl.load(vbase + 8 * vw_ss + v_off)
    c1 = gl.load(vbase + 8 * vw_ss + v_off + 4)
    d0 = gl.load(vbase + 9 * vw_ss + v_off)
    d1 = gl.load(vbase + 9 * vw_ss + v_off + 4)
    vsb = vs_row + s0 * vs_ss + vs_off
    vzb = vz_row + s0 * vs_ss + vs_off
    sa = gl.load(vsb)
    sb = gl.load(vsb + vs_ss)
    sc = gl.load(vsb + 8 * vs_ss)
    sd = gl.load(vsb + 9 * vs_ss)
    za = gl.load(vzb)
    zb = gl.load(vzb + vs_ss)
    zc = gl.load(vzb + 8 * vs_ss)
    zd = gl.load(vzb + 9 * vs_ss)

    return w_lo, w_hi, s_lo, z_lo, s_hi, z_hi, a0, a1, b0, b1, c0, c1, d0, d1, sa, sb, sc, sd, za, zb, zc, zd


@gluon.jit
def _keys(tile):
    """K [16 slots, 64 ranks] as the A operand, from _load's tile."""
    w_lo, w_hi, s_lo, z_lo, s_hi, z_hi, a0, a1, b0, b1, c0, c1, d0, d1, sa, sb, sc, sd, za, zb, zc, zd = tile
    s_lo = gl.convert_layout(gl.reshape(gl.join(s_lo, s_lo), [8, 8]), KEY_WORDS, assert_trivial=True)
    z_lo = gl.convert_layout(gl.reshape(gl.join(z_lo, z_lo), [8, 8]), KEY_WORDS, assert_trivial=True)
    s_hi = gl.convert_layout(gl.reshape(gl.join(s_hi, s_hi), [8, 8]), KEY_WORDS, assert_trivial=True)
    z_hi = gl.convert_layout(gl.reshape(gl.join(z_hi, z_hi), [8, 8]), KEY_WORDS, assert_trivial=True)
    KL = gl.inline_asm_elementwise(KEY_ASM, KEY_CONSTRAINTS, [w_lo, s_lo, z_lo], dtype=(gl.float16,) * 8,
                                   is_pure=True, pack=1)
    KH = gl.inline_asm_elementwise(KEY_ASM, KEY_CONSTRAINTS, [w_hi, s_hi, z_hi], dtype=(gl.float16,) * 8,
                                   is_pure=True, pack=1)
    # output k = 4 a + 2 b + c; joins: a, b, row 8, c
    x000 = gl.join(KL[0], KL[4])
    x001 = gl.join(KL[1], KL[5])
    x010 = gl.join(KL[2], KL[6])
    x011 = gl.join(KL[3], KL[7])
    y000 = gl.join(KH[0], KH[4])
    y001 = gl.join(KH[1], KH[5])
    y010 = gl.join(KH[2], KH[6])
    y011 = gl.join(KH[3], KH[7])
    x0 = gl.join(x000, x010)  # c = 0: [.., a, b]
    x1 = gl.join(x001, x011)
    y0 = gl.join(y000, y010)
    y1 = gl.join(y001, y011)
    kt = gl.join(gl.join(x0, y0), gl.join(x1, y1))  # [8 slot, 8 word, a, b, row8, c]
    kt = gl.reshape(kt, [8, 2, 2, 2, 2, 2, 2, 2])   # [slot, w2, w1, w0, a, b, row8, c]
    kt = gl.permute(kt, [6, 0, 3, 4, 5, 1, 2, 7])
    return gl.convert_layout(gl.reshape(kt, [16, 64]), A_OP, assert_trivial=True)


@gluon.jit
def _values(tile, v_shift):
    """VT [128 channels, 16 slots] as the A operand, from _load's tile."""
    w_lo, w_hi, s_lo, z_lo, s_hi, z_hi, a0, a1, b0, b1, c0, c1, d0, d1, sa, sb, sc, sd, za, zb, zc, zd = tile
    V0 = gl.inline_asm_elementwise(VALUE_ASM, VALUE_CONSTRAINTS, [a0, a1, b0, b1, v_shift, sa, sb, za, zb],
                                   dtype=(gl.float16,) * 32, is_pure=True, pack=1)
    V1 = gl.inline_asm_elementwise(VALUE_ASM, VALUE_CONSTRAINTS, [c0, c1, d0, d1, v_shift, sc, sd, zc, zd],
                                   dtype=(gl.float16,) * 32, is_pure=True, pack=1)
    return _value_operand(V0, V1)


@gluon.jit
def _key_channel(r):
    """The key channel (of the KV head's 64) that rank r of the key operand holds: r = 32 w0 + 16 a + 8 b + 4 w2 +
    2 w1 + c holds code [0, 4, 1, 5, 2, 6, 3, 7][4 a + 2 b + c] = 2 a + b + 4 c of word 4 w2 + 2 w1 + w0 (_keys'
    joins). Gluon code, and through its Python function (`key_rank_channels`) the launcher's."""
    return 8 * (4 * ((r >> 2) & 1) + 2 * ((r >> 1) & 1) + (r >> 5)) + 2 * ((r >> 4) & 1) + ((r >> 3) & 1) + 4 * (r & 1)


@gluon.jit
def _value_channel(ch):
    """The value channel (of the KV head's 128) that row ch of the value operand and of the context holds: lane
    g = ch % 8 holds 3-byte words 2g and 2g + 1 of the codes, ch // 64 picks the word and (ch // 8) % 8 the code in it
    (_value_operand's joins). Gluon code, and through its Python function (`value_channels`) the launcher's."""
    return 16 * (ch & 7) + 8 * (ch >> 6) + ((ch >> 3) & 7)


@gluon.jit
def _exact_tile(kx_row, vx_row, kx_ss, vx_ss, h, SINKS: gl.constexpr):
    """The sinks' exact latents (slots below SINKS, zeros after) as the products' operands: K [16 slots, 64 ranks]
    and VT [128 channels, 16 slots], ranks and channels in the code operands' orders (key_rank_channels,
    value_channels). Loaded once, by the first split."""
    s = gl.arange(0, 16, layout=gl.SliceLayout(1, A_OP))
    r = gl.arange(0, 64, layout=gl.SliceLayout(0, A_OP))
    keys = gl.load(kx_row + s[:, None] * kx_ss + (h * 64 + _key_channel(r))[None, :], mask=(s < SINKS)[:, None],
                   other=0.0)
    ch = gl.arange(0, 128, layout=gl.SliceLayout(1, A_OP))
    sv = gl.arange(0, 16, layout=gl.SliceLayout(0, A_OP))
    values = gl.load(vx_row + (h * 128 + _value_channel(ch))[:, None] + sv[None, :] * vx_ss,
                     mask=(sv < SINKS)[None, :], other=0.0)
    return keys, values


@gluon.jit
def far_kernel(kw_ptr, ks_ptr, kz_ptr, vw_ptr, vs_ptr, vz_ptr, kx_ptr, vx_ptr, q_ptr, far_hi_ptr, mask_ptr, m_ptr,
               l_ptr, acc_ptr, kw_sb, kw_sh2, ks_sb, ks_sh, vw_sb, vw_sh, vs_sb, vs_sh, kx_sb, kx_ss, vx_sb, vx_ss,
               mask_sb, splits, row_splits, kw_ss: gl.constexpr, ks_ss: gl.constexpr, vw_ss: gl.constexpr,
               vs_ss: gl.constexpr, mask_ss: gl.constexpr, KV_HEADS: gl.constexpr, GROUP_HEADS: gl.constexpr,
               SINKS: gl.constexpr, HAS_MASK: gl.constexpr):
    """Partials of split program_id(1) (of `splits`) of (batch row, KV head) program_id(0) over the slots [0, end) of
    its batch row b, all of them far (end: the least of far_hi_ptr[b * KV_HEADS + h] over its KV heads h, rounded
    down to a multiple of 64; `latent_decode.far_prep_kernel`'s firsts): written as the decode kernel writes its
    splits' (row (program_id(0) * row_splits + split) * GROUP_HEADS + query head of m_ptr, l_ptr: the running
    maximum in base 2 and the sum of 2^(score - m); of acc_ptr [rows, 128]: the latent context, unnormalized). The
    first SINKS slots (16 at most) come from their exact copies (kx_ptr, vx_ptr; their first rows), read by the
    first split. Strides in the elements of each pointer (kw_sh2: the key words' head stride, halved: even, so that
    a lane's two words load as one); q_ptr [rows * KV heads, 8 columns, 64 ranks] float16: the latent queries in the
    ranks' order (key_rank_channels), zero columns past the query heads of a KV head. HAS_MASK: a boolean mask over
    the slots (mask_ptr + b * mask_sb + slot * mask_ss, false: not attended; a row's left padding), whose splits may
    then see no slot (their maximum stays -inf, their sum 0)."""
    bh = gl.program_id(0)
    split = gl.program_id(1)
    b = bh // KV_HEADS
    h = bh % KV_HEADS
    heads = gl.arange(0, 64, layout=HEADS)  # where the row's far slots end: kernels/latent_decode.py's far_end
    firsts = gl.load(far_hi_ptr + b * KV_HEADS + heads, mask=heads < KV_HEADS, other=2 ** 30)
    n_far = gl.min(firsts, axis=0) // 64 * 64
    per_split = (((n_far + splits - 1) // splits + 63) // 64) * 64
    lo = split * per_split
    hi = gl.minimum(lo + per_split, n_far)
    kw_row = kw_ptr + b * kw_sb + h * (kw_sh2 * 2)
    ks_row = ks_ptr + b * ks_sb + h * ks_sh
    kz_row = kz_ptr + b * ks_sb + h * ks_sh
    vw_row = vw_ptr + b * vw_sb + h * vw_sh
    vs_row = vs_ptr + b * vs_sb + h * vs_sh
    vz_row = vz_ptr + b * vs_sb + h * vs_sh

    # the query (permuted ranks, scaled, base 2) as the B operand [64, 8]
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, B_OP))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
    q = gl.load(q_ptr + bh * 512 + c[None, :] * 64 + r[:, None])

    # key rows: [8 slots, 8 words] offsets of rows g (words of slot g, lane t holds 2t, 2t + 1)
    kg = gl.arange(0, 8, layout=gl.SliceLayout(1, KEY_WORDS))
    kwd = gl.arange(0, 8, layout=gl.SliceLayout(0, KEY_WORDS))
    k_off = kg[:, None] * kw_ss + kwd[None, :]
    lg = gl.arange(0, 8, layout=gl.SliceLayout(1, LANES))
    lt = gl.arange(0, 4, layout=gl.SliceLayout(0, LANES))
    ks_off = lg[:, None] * ks_ss + (lt // 2)[None, :]
    # values: lane (g, t): ints (g % 2) * 4 + g // 2 and that + 4 of slots 2t, 2t + 1, 2t + 8, 2t + 9
    v_int = (lg % 2) * 4 + lg // 2
    v_off = (2 * lt)[None, :] * vw_ss + v_int[:, None]            # slot 2t
    v_shift = ((lg % 2) * 16)[:, None] + 0 * lt[None, :]
    vs_off = (2 * lt)[None, :] * vs_ss + (lg // 2)[:, None]
    rows = (kw_row, ks_row, kz_row, vw_row, vs_row, vz_row)
    offsets = (k_off, ks_off, v_off, vs_off)

    m_i = gl.full([8], -float("inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_rows = gl.zeros([16, 8], gl.float32, layout=MMA)  # per-row sums, added over rows at the end
    acc = gl.zeros([128, 8], gl.float32, layout=MMA)
    slot = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    mask_row = mask_ptr + b * mask_sb
    if SINKS > 0:
        if (split == 0) & (n_far > 0):
            keys, values = _exact_tile(kx_ptr + b * kx_sb, vx_ptr + b * vx_sb, kx_ss, vx_ss, h, SINKS)
            scores = mma_v2(keys, q, gl.zeros([16, 8], gl.float32, layout=MMA))
            scores = gl.where((slot < SINKS)[:, None], scores, -float("inf"))
            if HAS_MASK:
                scores = _masked(scores, mask_row, 0, slot, mask_ss)
            m_i = gl.max(scores, axis=0)
            l_rows = _ex2(scores - _finite(m_i)[None, :])
            acc = mma_v2(values, gl.convert_layout(l_rows.to(gl.float16), B_OP), acc)
    for s0 in range(lo, hi, 64):
        t0 = _load(rows, s0 + 0, offsets, kw_ss, ks_ss, vw_ss, vs_ss)
        t1 = _load(rows, s0 + 16, offsets, kw_ss, ks_ss, vw_ss, vs_ss)
        t2 = _load(rows, s0 + 32, offsets, kw_ss, ks_ss, vw_ss, vs_ss)
        t3 = _load(rows, s0 + 48, offsets, kw_ss, ks_ss, vw_ss, vs_ss)
        sc0 = mma_v2(_keys(t0), q, gl.zeros([16, 8], gl.float32, layout=MMA))
        if SINKS > 0:  # the sinks' codes: their exact copies came first
            sc0 = gl.where((s0 + slot >= SINKS)[:, None], sc0, -float("inf"))
        sc1 = mma_v2(_keys(t1), q, gl.zeros([16, 8], gl.float32, layout=MMA))
        sc2 = mma_v2(_keys(t2), q, gl.zeros([16, 8], gl.float32, layout=MMA))
        sc3 = mma_v2(_keys(t3), q, gl.zeros([16, 8], gl.float32, layout=MMA))
        if HAS_MASK:
            sc0 = _masked(sc0, mask_row, s0, slot, mask_ss)
            sc1 = _masked(sc1, mask_row, s0 + 16, slot, mask_ss)
            sc2 = _masked(sc2, mask_row, s0 + 32, slot, mask_ss)
            sc3 = _masked(sc3, mask_row, s0 + 48, slot, mask_ss)
        m_new = gl.maximum(m_i, gl.max(gl.maximum(gl.maximum(sc0, sc1), gl.maximum(sc2, sc3)), axis=0))
        m_use = m_new
        if HAS_MASK:  # no slot seen yet (m_new -inf): exponents against 0, not -inf - -inf
            m_use = _finite(m_new)
        alpha = _ex2(m_i - m_use)
        p0 = _ex2(sc0 - m_use[None, :])
        p1 = _ex2(sc1 - m_use[None, :])
        p2 = _ex2(sc2 - m_use[None, :])
        p3 = _ex2(sc3 - m_use[None, :])
        l_rows = l_rows * alpha[None, :] + ((p0 + p1) + (p2 + p3))
        acc = acc * alpha[None, :]
        m_i = m_new
        acc = mma_v2(_values(t0, v_shift), gl.convert_layout(p0.to(gl.float16), B_OP), acc)
        acc = mma_v2(_values(t1, v_shift), gl.convert_layout(p1.to(gl.float16), B_OP), acc)
        acc = mma_v2(_values(t2, v_shift), gl.convert_layout(p2.to(gl.float16), B_OP), acc)
        acc = mma_v2(_values(t3, v_shift), gl.convert_layout(p3.to(gl.float16), B_OP), acc)

    # the partials, the context's channels in the cache's order
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    row = (bh * row_splits + split) * GROUP_HEADS + cols
    ok = cols < GROUP_HEADS
    gl.store(m_ptr + row, m_i, mask=ok)
    gl.store(l_ptr + row, gl.sum(l_rows, axis=0), mask=ok)
    ch = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    gl.store(acc_ptr + row[None, :] * 128 + _value_channel(ch)[:, None], acc, mask=ok[None, :])


@gluon.jit
def _value_operand(V0, V1):
    """VT [128 channels, 16 slots] as the A operand, from the value asm's outputs for slot pairs P = 0 (2t, 2t + 1)
    and 1 (2t + 8, 2t + 9): VP[2 (8 X + i) + s] is code i of word X of slot s of the pair. The joins go over X, i's
    bits 2 and 1, P, i's bit 0, then s: the operand's register order, its fastest bit last."""
    l1_0_0_0 = gl.join(V0[0], V0[16])
    l1_0_0_1 = gl.join(V0[1], V0[17])
    l1_0_1_0 = gl.join(V0[2], V0[18])
    l1_0_1_1 = gl.join(V0[3], V0[19])
    l1_0_2_0 = gl.join(V0[4], V0[20])
    l1_0_2_1 = gl.join(V0[5], V0[21])
    l1_0_3_0 = gl.join(V0[6], V0[22])
    l1_0_3_1 = gl.join(V0[7], V0[23])
    l1_0_4_0 = gl.join(V0[8], V0[24])
    l1_0_4_1 = gl.join(V0[9], V0[25])
    l1_0_5_0 = gl.join(V0[10], V0[26])
    l1_0_5_1 = gl.join(V0[11], V0[27])
    l1_0_6_0 = gl.join(V0[12], V0[28])
    l1_0_6_1 = gl.join(V0[13], V0[29])
    l1_0_7_0 = gl.join(V0[14], V0[30])
    l1_0_7_1 = gl.join(V0[15], V0[31])
    l1_1_0_0 = gl.join(V1[0], V1[16])
    l1_1_0_1 = gl.join(V1[1], V1[17])
    l1_1_1_0 = gl.join(V1[2], V1[18])
    l1_1_1_1 = gl.join(V1[3], V1[19])
    l1_1_2_0 = gl.join(V1[4], V1[20])
    l1_1_2_1 = gl.join(V1[5], V1[21])
    l1_1_3_0 = gl.join(V1[6], V1[22])
    l1_1_3_1 = gl.join(V1[7], V1[23])
    l1_1_4_0 = gl.join(V1[8], V1[24])
    l1_1_4_1 = gl.join(V1[9], V1[25])
    l1_1_5_0 = gl.join(V1[10], V1[26])
    l1_1_5_1 = gl.join(V1[11], V1[27])
    l1_1_6_0 = gl.join(V1[12], V1[28])
    l1_1_6_1 = gl.join(V1[13], V1[29])
    l1_1_7_0 = gl.join(V1[14], V1[30])
    l1_1_7_1 = gl.join(V1[15], V1[31])
    l2_0_0_0 = gl.join(l1_0_0_0, l1_0_4_0)
    l2_0_0_1 = gl.join(l1_0_0_1, l1_0_4_1)
    l2_0_1_0 = gl.join(l1_0_1_0, l1_0_5_0)
    l2_0_1_1 = gl.join(l1_0_1_1, l1_0_5_1)
    l2_0_2_0 = gl.join(l1_0_2_0, l1_0_6_0)
    l2_0_2_1 = gl.join(l1_0_2_1, l1_0_6_1)
    l2_0_3_0 = gl.join(l1_0_3_0, l1_0_7_0)
    l2_0_3_1 = gl.join(l1_0_3_1, l1_0_7_1)
    l2_1_0_0 = gl.join(l1_1_0_0, l1_1_4_0)
    l2_1_0_1 = gl.join(l1_1_0_1, l1_1_4_1)
    l2_1_1_0 = gl.join(l1_1_1_0, l1_1_5_0)
    l2_1_1_1 = gl.join(l1_1_1_1, l1_1_5_1)
    l2_1_2_0 = gl.join(l1_1_2_0, l1_1_6_0)
    l2_1_2_1 = gl.join(l1_1_2_1, l1_1_6_1)
    l2_1_3_0 = gl.join(l1_1_3_0, l1_1_7_0)
    l2_1_3_1 = gl.join(l1_1_3_1, l1_1_7_1)
    l3_0_0_0 = gl.join(l2_0_0_0, l2_0_2_0)
    l3_0_0_1 = gl.join(l2_0_0_1, l2_0_2_1)
    l3_0_1_0 = gl.join(l2_0_1_0, l2_0_3_0)
    l3_0_1_1 = gl.join(l2_0_1_1, l2_0_3_1)
    l3_1_0_0 = gl.join(l2_1_0_0, l2_1_2_0)
    l3_1_0_1 = gl.join(l2_1_0_1, l2_1_2_1)
    l3_1_1_0 = gl.join(l2_1_1_0, l2_1_3_0)
    l3_1_1_1 = gl.join(l2_1_1_1, l2_1_3_1)
    l4_0_0 = gl.join(l3_0_0_0, l3_1_0_0)
    l4_0_1 = gl.join(l3_0_0_1, l3_1_0_1)
    l4_1_0 = gl.join(l3_0_1_0, l3_1_1_0)
    l4_1_1 = gl.join(l3_0_1_1, l3_1_1_1)
    l5_0 = gl.join(l4_0_0, l4_1_0)
    l5_1 = gl.join(l4_0_1, l4_1_1)
    vt = gl.join(l5_0, l5_1)  # [8 g, 4 t, X, i2, i1, P, i0, s]
    vt = gl.permute(vt, [2, 3, 4, 6, 0, 5, 1, 7])  # [X, i2, i1, i0, g, P, t, s]
    v_a = gl.convert_layout(gl.reshape(vt, [128, 16]), A_OP, assert_trivial=True)
    return v_a


def key_rank_channels() -> list[int]:
    """The key channel each rank of the key operand holds (`_key_channel`)."""
    return [_key_channel.fn(r) for r in range(64)]


def value_channels() -> list[int]:
    """The value channel each row of the value operand and of the context holds (`_value_channel`)."""
    return [_value_channel.fn(ch) for ch in range(128)]
