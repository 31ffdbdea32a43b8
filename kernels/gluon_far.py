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

One warp per program owns its slots from codes to context. Per 16 slots, transposed mma.sync products (m16n8k16):
scoresT [16 slots, 8 columns] = K [16 slots, 64 ranks] @ qT [64, 8] and ctxT [128 channels, 8] += VT [128 channels,
16 slots] @ pT [16 slots, 8]; four such groups per iteration of 64 slots share one online-softmax update, their values
dequantized after it, each just before its product (or, where a KV head serves one query head, taken raw: FOLD).
Each 64-slot tile's codes, scales and zero points come into shared memory by cp.async while the tile before it is
computed (two stages, 13 KB a program). The warp waits on its
own copies and on two barriers a tile (the second is Triton's own, before the first shared-memory read), with no
other warp to wait for. So a warp's loads overlap its compute; with the codes loaded straight into registers, every
warp waited on its own loads once a tile (docs/gpu-notes.md). From shared memory the codes load straight into the
operands' layouts: lane (g, t) reads int32 words 2t and 2t + 1 of the key codes of slots g and g + 8, and the three
words of value codes of block g // 2 (channels 32 (g // 2) ..) of slots 2t, 2t + 1, 2t + 8 and 2t + 9, of which it
takes the 48 bits of channels 16g .. 16g + 15. PTX turns them into float16 two at a time (a key word's codes i and
i + 4, one value channel of two slots), and joins, a reshape and a permute give the operands' layouts, which
convert_layout asserts need no data movement. So the operands' ranks and channels are permuted: `key_rank_channels`
and `value_channels` say which cache channel each holds; the queries come permuted, the context is stored in the
cache's order. Where a KV head serves one query head, the scales and zero points apply outside the codes: the
values' in the value product's B operand, the keys' to the scores' product (`far_kernel`'s FOLD).
"""
import struct

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# cp.async into shared memory: `async_load` from Triton 3.9 on (which refuses the older name), before it
# `async_copy_global_to_shared` (3.6, the GPU machine's version)
_copy = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # a CTA's barrier: `barrier` from 3.9 on


def _half2(value: float) -> str:
    """A float16 constant twice over, as a PTX .b32 immediate."""
    bits = struct.unpack("<H", struct.pack("<e", value))[0]
    return f"0x{bits:04x}{bits:04x}"


def _pairs_asm(pairs, shifts, bits, scales, prologue, registers=(), predicates=()) -> str:
    """PTX turning codes into float16 latents two at a time. Output pair k (outputs 2k and 2k + 1, the low and high
    halves of a register) takes its codes at bit shifts[k] of each 16-bit half of a register: pairs[k] = (selector,
    x, y) gathers it by prmt from registers x and y, or (None, x, None) takes register x as it is. lop3 masks the
    code into the mantissa of 1024, an exact fma takes 1024 away and divides by 2^shift, a last fma applies the
    (scale, zero point) pairs s2 and z2 that the lines `scales` set (after `prologue`, whose own registers are
    `registers` and `predicates`). With `scales` None the outputs are the lop3's, 1024 + code * 2^shift, which the
    folded products take as they are (`far_kernel`'s FOLD)."""
    raw = scales is None
    lines = [*prologue, *(scales or [])]
    for shift in sorted(set(shifts)) if not raw else ():  # f16x2 operands are registers
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
        if not raw:
            lines.append(f"fma.rn.f16x2 t, t, m{shift}, a{shift};")
            lines.append("fma.rn.f16x2 t, t, s2, z2;")
        lines.append(f"mov.b32 {{${2 * k}, ${2 * k + 1}}}, t;")
    names = ", ".join(["s2, z2, t, w, x0, x1, y0, y1", *(f"m{shift}, a{shift}" for shift in sorted(set(shifts))
                                                         if not raw), *registers])
    declared = "".join(f".reg .pred {name};\n" for name in predicates)
    return "{\n" + declared + ".reg .b32 " + names + ";\n" + "\n".join(lines) + "\n}"


def _key_asm(fold: bool = False) -> str:
    """Inputs $8 (an int32 word of 8 4-bit codes, code k at bits 4k), $9 and $10 (the slot's two groups' float16
    scales, then zero points, as int32 words), $11 (the prmt selector of the word's group: 0x1010 or 0x3232).
    Outputs: codes 0, 4, 1, 5, 2, 6, 3, 7 (pairs (i, i + 4) lie at bits 4i and 4i + 16: of the word, then of the word
    shifted by 8), so odd codes at a shift of 4. `fold`: no scale inputs, the outputs 1024 + code * 2^shift."""
    pairs = [(None, "$8", None)] * 2 + [(None, "y0", None)] * 2
    scales = None if fold else ["prmt.b32 s2, $9, $9, $11;", "prmt.b32 z2, $10, $10, $11;"]
    return _pairs_asm(pairs, [0, 4, 0, 4], 4, scales, ["shr.u32 y0, $8, 8;"])


def _value_pairs():
    pairs, shifts = [], []
    for a, b in (("x0", "y1"), ("x1", "y0")):
        for i in range(8):
            byte, shift = divmod(3 * i, 8)
            pairs.append((byte | (byte + 1) << 4 | (4 + byte) << 8 | (5 + byte) << 12, a, b))
            shifts.append(shift)
    return pairs, shifts


def _value_asm(fold: bool = False) -> str:
    """Inputs $32 $33 $34 (int32 words 0, 1 and 2 of slot A's 32-channel block of codes), $35 $36 $37 (slot B's),
    $38 (the bit, 0 or 16, where the lane's 48 bits begin: words 0 and 1 from bit 0, or 1 and 2 from bit 16), $39 $40
    (the int32 words of A's and B's float16 scales that hold the block's), $41 $42 (their zero points'), $43 (the prmt
    selector of the block's halves: 0x5410 or 0x7632). Output pair 8X + i holds code i of 3-byte word X (of the 48
    bits) of slot A, then of slot B. `fold`: no scale inputs, the outputs 1024 + code * 2^((3 i) % 8) (`_pairs_asm`)."""
    prologue = ["setp.ne.u32 p, $38, 0;",
                "selp.b32 u0, $33, $32, p;", "selp.b32 u1, $34, $33, p;",      # A's two words
                "selp.b32 v0, $36, $35, p;", "selp.b32 v1, $37, $36, p;",      # B's
                "shf.r.wrap.b32 x0, u0, u1, $38;", "shr.u32 y0, u1, $38;",     # A's 48 bits: x0, then y0
                "shf.r.wrap.b32 x1, x0, y0, 24;",                              # A's word 1 at bit 0 of x1
                "shf.r.wrap.b32 y1, v0, v1, $38;", "shr.u32 w, v1, $38;",      # B's 48 bits: y1, then w
                "shf.r.wrap.b32 w, y1, w, 24;", "mov.b32 y0, w;"]              # B's word 1 in y0 (prmt takes w)
    scales = None if fold else ["prmt.b32 s2, $39, $40, $43;", "prmt.b32 z2, $41, $42, $43;"]
    return _pairs_asm(*_value_pairs(), 3, scales, prologue, ["u0", "u1", "v0", "v1"], ["p"])


KEY_ASM = gl.constexpr(_key_asm())
KEY_CONSTRAINTS = gl.constexpr("=h," * 8 + "r,r,r,r")
VALUE_ASM = gl.constexpr(_value_asm())
VALUE_CONSTRAINTS = gl.constexpr("=h," * 32 + ",".join("r" * 12))
# FOLD's: the codes raw, a float16 pair (an int32 word) as two float32
RAW_KEY_ASM = gl.constexpr(_key_asm(fold=True))
RAW_KEY_CONSTRAINTS = gl.constexpr("=h," * 8 + "r")
RAW_VALUE_ASM = gl.constexpr(_value_asm(fold=True))
RAW_VALUE_CONSTRAINTS = gl.constexpr("=h," * 32 + ",".join("r" * 7))
HALVES_ASM = gl.constexpr("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.f32.f16 $0, lo;\ncvt.f32.f16 $1, hi;\n}")
# the folded value product's B operand, p times a slot's scale (or zero point), two at a time
SCALE_P_ASM = gl.constexpr("mul.rn.f16x2 $0, $1, $2;")
# FOLD's weights are 2^(score - max + FOLD_SHIFT), so that weights times value scales stay normal float16: the
# products' B operand holds them, in float16, so this first pass needs value scales and zero points under 256 (3-bit
# codes over a range under 1,792). A split whose context comes out inf or NaN (`_overflowed`) is computed again with
# weights 2^(score - max + SAFE_SHIFT), at most 1/2 (1 would do; 1/2 for margin), whose products with any float16
# scale stay finite (`far_kernel`).
FOLD_SHIFT = gl.constexpr(8)
SAFE_SHIFT = gl.constexpr(-1)

# layouts of one warp: the products' accumulator and operands
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
# FOLD's scores [16 slots, 4]: MMA [16, 8] with its columns (2 j + key group g) split by group
SCORES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[],
    shape=[16, 4]))
# MMA over [128, 8] as [8 tiles of 16 rows, 16, 8]
MMA_TILES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 8, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[], block_bases=[],
    shape=[8, 16, 8]))
# key words [8 slots, 8 words]: lane (g, t) holds words 2t and 2t + 1 of slot g (blocked: it broadcasts a slot's
# scales over its words)
KEY_WORDS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[8, 4], warps_per_cta=[1, 1],
                                          order=[1, 0]))
HEADS = gl.constexpr(gl.BlockedLayout(size_per_thread=[2], threads_per_warp=[32], warps_per_cta=[1], order=[0]))
# the mask's check over a split's slots (`_all_kept`): 16 consecutive slots a lane
CHECK = gl.constexpr(gl.BlockedLayout(size_per_thread=[16], threads_per_warp=[32], warps_per_cta=[1], order=[0]))
# [8, 4]: element (g, t) in lane (g, t)
LANES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[8, 4]))
# [4, 2, 4]: lane (g, t) holds element (g // 2, g % 2, t): LANES in three dimensions (blocked: it broadcasts a
# block's scales over the two lanes of the block)
LANES3 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 1], threads_per_warp=[4, 2, 4],
                                       warps_per_cta=[1, 1, 1], order=[2, 1, 0]))
# [2, 4, 4]: lane (g, t) holds element (g // 4, g % 4, t) (broadcasts a word of scales over four lanes)
LANES3W = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 1], threads_per_warp=[2, 4, 4],
                                        warps_per_cta=[1, 1, 1], order=[2, 1, 0]))
# [16 slots, 4 words]: lane (g, t) holds word g // 2 of slots 2t, 2t + 1, 2t + 8 and 2t + 9 (its registers)
SLOT_PAIRS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [8, 0]], lane_bases=[[2, 0], [4, 0], [0, 0], [0, 1], [0, 2]], warp_bases=[], block_bases=[],
    shape=[16, 4]))
# [16 slots, 2 words]: lane (g, t) holds word g // 4 of the same slots
SLOT_PAIRS_W = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [8, 0]], lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 1]], warp_bases=[], block_bases=[],
    shape=[16, 2]))
# shared memory: two stages of 64 slots, unswizzled, [2, 64] or [2, 64, columns]
SMEM1 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
SMEM2 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
# the copies into it: [64 slots, 8 / 4 / 2 int32 words] (16, 16 and 8 bytes a lane a copy) and [64]
COPY_8 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[16, 2], warps_per_cta=[1, 1],
                                       order=[1, 0]))
COPY_4 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32, 1], warps_per_cta=[1, 1],
                                       order=[1, 0]))
COPY_2 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[32, 1], warps_per_cta=[1, 1],
                                       order=[1, 0]))
COPY_1 = gl.constexpr(gl.BlockedLayout(size_per_thread=[2], threads_per_warp=[32], warps_per_cta=[1], order=[0]))
# FOLD's value scales and zero points, float16 [64 slots, 4 groups] (8 bytes a lane a copy)
COPY_H4 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32, 1], warps_per_cta=[1, 1],
                                        order=[1, 0]))


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
def _all_kept(mask_row, lo, hi, mask_ss: gl.constexpr):
    """Whether the boolean mask keeps every slot of [lo, hi): then the split's tiles skip its loads. 2,048 slots a
    step, 64 a lane (four 16-byte loads where the mask is contiguous), all issued before any is waited on."""
    slots = gl.arange(0, 2048, layout=CHECK)
    dropped = gl.to_tensor(0)
    for c in range(lo, hi, 2048):
        keep = gl.load(mask_row + (c + slots) * mask_ss, mask=c + slots < hi, other=True)
        dropped += gl.sum(gl.where(keep, 0, 1), axis=0)
    return dropped == 0


@gluon.jit
def _finite(maxima):
    """Running maxima with -inf (no slot seen) taken as 0, so that 2^(score - max) is 0, not NaN."""
    return gl.where(maxima == -float("inf"), 0.0, maxima)


@gluon.jit
def _key_operand(KL, KH):
    """K [16 slots, 64 ranks] as the A operand, from the key asm's outputs for slots g (KL) and g + 8 (KH)."""
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
def _issue(bufs, rows, stage, s0, kw_ss: gl.constexpr, ks_ss: gl.constexpr, vw_ss: gl.constexpr,
           vs_ss: gl.constexpr, FOLD: gl.constexpr):
    """cp.async of the 64 slots from s0 into shared-memory stage `stage`, as one group. FOLD: the value scales
    and zero points are float16 (vs_row, vz_row) and land in one buffer (vs_s), a slot's four scales, then its four
    zero points."""
    kw_s, ks_s, kz_s, va_s, vb_s, vs_s, vz_s = bufs
    kw_row, ks_row, kz_row, vw_row, vs_row, vz_row = rows
    s8 = s0 + gl.arange(0, 64, layout=gl.SliceLayout(1, COPY_8))
    w8 = gl.arange(0, 8, layout=gl.SliceLayout(0, COPY_8))
    _copy(kw_s.index(stage), kw_row + s8[:, None] * kw_ss + w8[None, :])
    _copy(va_s.index(stage), vw_row + s8[:, None] * vw_ss + w8[None, :])
    s4 = s0 + gl.arange(0, 64, layout=gl.SliceLayout(1, COPY_4))
    w4 = gl.arange(0, 4, layout=gl.SliceLayout(0, COPY_4))
    _copy(vb_s.index(stage), vw_row + s4[:, None] * vw_ss + (8 + w4)[None, :])
    if FOLD:
        sh = s0 + gl.arange(0, 64, layout=gl.SliceLayout(1, COPY_H4))
        wh = gl.arange(0, 4, layout=gl.SliceLayout(0, COPY_H4))
        _copy(vs_s.index(stage).slice(0, 4, dim=1), vs_row + sh[:, None] * (2 * vs_ss) + wh[None, :])
        _copy(vs_s.index(stage).slice(4, 4, dim=1), vz_row + sh[:, None] * (2 * vs_ss) + wh[None, :])
    else:
        s2 = s0 + gl.arange(0, 64, layout=gl.SliceLayout(1, COPY_2))
        w2 = gl.arange(0, 2, layout=gl.SliceLayout(0, COPY_2))
        _copy(vs_s.index(stage), vs_row + s2[:, None] * vs_ss + w2[None, :])
        _copy(vz_s.index(stage), vz_row + s2[:, None] * vs_ss + w2[None, :])
    s1 = s0 + gl.arange(0, 64, layout=COPY_1)
    _copy(ks_s.index(stage), ks_row + s1 * ks_ss)
    _copy(kz_s.index(stage), kz_row + s1 * ks_ss)
    async_copy.commit_group()


@gluon.jit
def _keys(kw_s, ks_s, kz_s, r0: gl.constexpr, selector):
    """K [16 slots, 64 ranks] as the A operand, from the stage's slots r0 .. r0 + 15 (shared memory)."""
    w_lo = kw_s.slice(r0, 8).load(KEY_WORDS)
    w_hi = kw_s.slice(r0 + 8, 8).load(KEY_WORDS)
    s_lo = gl.expand_dims(ks_s.slice(r0, 8).load(gl.SliceLayout(1, KEY_WORDS)), 1)
    z_lo = gl.expand_dims(kz_s.slice(r0, 8).load(gl.SliceLayout(1, KEY_WORDS)), 1)
    s_hi = gl.expand_dims(ks_s.slice(r0 + 8, 8).load(gl.SliceLayout(1, KEY_WORDS)), 1)
    z_hi = gl.expand_dims(kz_s.slice(r0 + 8, 8).load(gl.SliceLayout(1, KEY_WORDS)), 1)
    KL = gl.inline_asm_elementwise(KEY_ASM, KEY_CONSTRAINTS, [w_lo, s_lo, z_lo, selector], dtype=(gl.float16,) * 8,
                                   is_pure=True, pack=1)
    KH = gl.inline_asm_elementwise(KEY_ASM, KEY_CONSTRAINTS, [w_hi, s_hi, z_hi, selector], dtype=(gl.float16,) * 8,
                                   is_pure=True, pack=1)
    return _key_operand(KL, KH)


@gluon.jit
def _raw_keys(kw_s, r0: gl.constexpr):
    """K [16 slots, 64 ranks] as the A operand, 1024 + code * 2^shift, from the stage's slots r0 .. r0 + 15
    (FOLD: the scales apply to the scores, `_folded_scores`)."""
    KL = gl.inline_asm_elementwise(RAW_KEY_ASM, RAW_KEY_CONSTRAINTS, [kw_s.slice(r0, 8).load(KEY_WORDS)],
                                   dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    KH = gl.inline_asm_elementwise(RAW_KEY_ASM, RAW_KEY_CONSTRAINTS, [kw_s.slice(r0 + 8, 8).load(KEY_WORDS)],
                                   dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    return _key_operand(KL, KH)


@gluon.jit
def _halves(words):
    """int32 words of float16 pairs -> (low halves, high halves) as float32."""
    return gl.inline_asm_elementwise(HALVES_ASM, "=f,=f,r", [words], dtype=(gl.float32, gl.float32), is_pure=True,
                                     pack=1)


@gluon.jit
def _folded_scores(kw_s, ks_s, kz_s, q_fold, offset, sums0, sums1, r0: gl.constexpr):
    """FOLD's scores [16 slots, 8] of the stage's slots r0 .. r0 + 15, the one query head's in every column. The
    product of the raw keys with q_fold (column 2 j + g: the query over key group g's ranks, those at a shift of 4
    divided by 16) starts from `offset` (-1024 times each column's sum), so it leaves the query times the codes per
    group; each slot's group scales s_g and zero points z_g then make the score, sum over g of s_g (that) + z_g
    (sums_g: the query summed over group g's ranks)."""
    raw = mma_v2(_raw_keys(kw_s, r0), q_fold, offset)
    raw0, raw1 = gl.split(gl.reshape(raw, [16, 4, 2]))
    raw0 = gl.convert_layout(raw0, SCORES, assert_trivial=True)
    raw1 = gl.convert_layout(raw1, SCORES, assert_trivial=True)
    s0, s1 = _halves(ks_s.slice(r0, 16).load(gl.SliceLayout(1, SCORES)))
    z0, z1 = _halves(kz_s.slice(r0, 16).load(gl.SliceLayout(1, SCORES)))
    score = raw0 * s0[:, None] + z0[:, None] * sums0[None, :]
    score = score + raw1 * s1[:, None] + z1[:, None] * sums1[None, :]
    return gl.convert_layout(gl.reshape(gl.join(score, score), [16, 8]), MMA, assert_trivial=True)


@gluon.jit
def _lanes(x, like, layout: gl.constexpr):
    """A [words, 4 t] tensor of SLOT_PAIRS' (or SLOT_PAIRS_W's) words as LANES [8, 4]: `like` zeros [words, 8 // words,
    4] in `layout`, over which each word broadcasts to its lanes."""
    x = gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, layout), assert_trivial=True), 1)
    x = gl.broadcast(x, like)[0]
    return gl.convert_layout(gl.reshape(x, [8, 4]), LANES, assert_trivial=True)


@gluon.jit
def _pairs(x, like, layout: gl.constexpr):
    """[16 slots, words] in SLOT_PAIRS (or SLOT_PAIRS_W) -> slots 2t, 2t + 1, 2t + 8, 2t + 9 as LANES [8, 4]."""
    x = gl.permute(gl.reshape(x, [2, 4, 2, x.shape[1]]), [3, 1, 0, 2])  # [word, t, P, d]: slot 8 P + 2 t + d
    even, odd = gl.split(x)
    a, c = gl.split(even)
    b, d = gl.split(odd)
    return _lanes(a, like, layout), _lanes(b, like, layout), _lanes(c, like, layout), _lanes(d, like, layout)


@gluon.jit
def _value_words(va_s, vb_s, r0: gl.constexpr):
    """The value codes of the stage's slots r0 .. r0 + 15 as the lanes take them: int32 words 0, 1 and 2 (j0, j1, j2)
    of the lane's 32-channel block, of slots 2t, 2t + 1, 2t + 8 and 2t + 9 (a, b, c, d)."""
    codes = gl.zeros([4, 2, 4], gl.int32, layout=LANES3)
    va = va_s.slice(r0, 16)
    j0a, j0b, j0c, j0d = _pairs(va.slice(0, 4, dim=1).load(SLOT_PAIRS), codes, LANES3)
    j1a, j1b, j1c, j1d = _pairs(va.slice(4, 4, dim=1).load(SLOT_PAIRS), codes, LANES3)
    j2a, j2b, j2c, j2d = _pairs(vb_s.slice(r0, 16).load(SLOT_PAIRS), codes, LANES3)
    return j0a, j0b, j0c, j0d, j1a, j1b, j1c, j1d, j2a, j2b, j2c, j2d


@gluon.jit
def _values(va_s, vb_s, vs_s, vz_s, r0: gl.constexpr, v_shift, v_selector):
    """VT [128 channels, 16 slots] as the A operand, from the stage's slots r0 .. r0 + 15 (shared memory)."""
    scales = gl.zeros([2, 4, 4], gl.int32, layout=LANES3W)
    j0a, j0b, j0c, j0d, j1a, j1b, j1c, j1d, j2a, j2b, j2c, j2d = _value_words(va_s, vb_s, r0)
    sa, sb, sc, sd = _pairs(vs_s.slice(r0, 16).load(SLOT_PAIRS_W), scales, LANES3W)
    za, zb, zc, zd = _pairs(vz_s.slice(r0, 16).load(SLOT_PAIRS_W), scales, LANES3W)
    V0 = gl.inline_asm_elementwise(VALUE_ASM, VALUE_CONSTRAINTS, [j0a, j1a, j2a, j0b, j1b, j2b, v_shift, sa, sb, za,
                                                                  zb, v_selector], dtype=(gl.float16,) * 32,
                                   is_pure=True, pack=1)
    V1 = gl.inline_asm_elementwise(VALUE_ASM, VALUE_CONSTRAINTS, [j0c, j1c, j2c, j0d, j1d, j2d, v_shift, sc, sd, zc,
                                                                  zd, v_selector], dtype=(gl.float16,) * 32,
                                   is_pure=True, pack=1)
    return _value_operand(V0, V1)


@gluon.jit
def _raw_values(va_s, vb_s, r0: gl.constexpr, v_shift):
    """VT [128 channels, 16 slots] as the A operand, 1024 + code * 2^shift, from the stage's slots r0 .. r0 + 15
    (FOLD: the scales go into the B operand, `_scaled_weights`)."""
    j0a, j0b, j0c, j0d, j1a, j1b, j1c, j1d, j2a, j2b, j2c, j2d = _value_words(va_s, vb_s, r0)
    V0 = gl.inline_asm_elementwise(RAW_VALUE_ASM, RAW_VALUE_CONSTRAINTS, [j0a, j1a, j2a, j0b, j1b, j2b, v_shift],
                                   dtype=(gl.float16,) * 32, is_pure=True, pack=1)
    V1 = gl.inline_asm_elementwise(RAW_VALUE_ASM, RAW_VALUE_CONSTRAINTS, [j0c, j1c, j2c, j0d, j1d, j2d, v_shift],
                                   dtype=(gl.float16,) * 32, is_pure=True, pack=1)
    return _value_operand(V0, V1)


@gluon.jit
def _scaled_weights(p, vsz_s, r0: gl.constexpr):
    """FOLD's B operand [16 slots, 8]: column n < 4 the weights p [16 slots, 8] (every column the one query
    head's) times value group n's scale of each slot, column 4 + n times its zero point (vsz_s: the stage's float16
    [64 slots, 8], `_issue`)."""
    weights = gl.convert_layout(p.to(gl.float16), B_OP)
    scales = vsz_s.slice(r0, 16).load(B_OP)
    return gl.inline_asm_elementwise(SCALE_P_ASM, "=r,r,r", [weights, scales], dtype=gl.float16, is_pure=True,
                                     pack=2)


@gluon.jit
def _folded_tile(acc, sums, alpha, p0, p1, p2, p3, va_s, vb_s, vsz_s, v_shift):
    """FOLD's value product of the stage's 64 slots (weights p0 .. p3 [16 slots, 8] each) into the context acc
    [128, 8] and the B operand's column sums [16, 8] (every row alike), both first scaled by alpha. The codes come as
    1024 + code * 2^shift: the tile's product starts from -1024 times the tile's column sums, so that what it adds to
    acc holds code * 2^shift only (float32 sums of the 1024s over a whole split lost the codes' share)."""
    w0 = _scaled_weights(p0, vsz_s, 0)
    w1 = _scaled_weights(p1, vsz_s, 16)
    w2 = _scaled_weights(p2, vsz_s, 32)
    w3 = _scaled_weights(p3, vsz_s, 48)
    ones = gl.full([16, 16], 1.0, gl.float16, layout=A_OP)
    tile_sums = mma_v2(ones, w0, gl.zeros([16, 8], gl.float32, layout=MMA))
    tile_sums = mma_v2(ones, w1, tile_sums)
    tile_sums = mma_v2(ones, w2, tile_sums)
    tile_sums = mma_v2(ones, w3, tile_sums)
    offset = gl.expand_dims(gl.convert_layout(tile_sums * -1024.0, gl.SliceLayout(0, MMA_TILES), assert_trivial=True),
                            0)
    offset = gl.broadcast(offset, gl.zeros([8, 16, 8], gl.float32, layout=MMA_TILES))[0]
    tile = gl.convert_layout(gl.reshape(offset, [128, 8]), MMA, assert_trivial=True)
    tile = mma_v2(_raw_values(va_s, vb_s, 0, v_shift), w0, tile)
    tile = mma_v2(_raw_values(va_s, vb_s, 16, v_shift), w1, tile)
    tile = mma_v2(_raw_values(va_s, vb_s, 32, v_shift), w2, tile)
    tile = mma_v2(_raw_values(va_s, vb_s, 48, v_shift), w3, tile)
    return acc * alpha[None, :] + tile, sums * alpha[None, :] + tile_sums


@gluon.jit
def _value_shift(ch):
    """The bit shift (within its 16-bit half) at which the value asm finds the code of operand row ch: code i of a
    3-byte word lies at bit 3 i, i = (ch // 8) % 8 (_value_operand's joins)."""
    return (3 * ((ch >> 3) & 7)) % 8


@gluon.jit
def _empty():
    """The partials of no slot: running maxima [8] -inf, sums [16, 8] (every row alike), context [128, 8] and FOLD's
    column sums [16, 8] zero."""
    return (gl.full([8], -float("inf"), gl.float32, layout=gl.SliceLayout(0, MMA)),
            gl.zeros([16, 8], gl.float32, layout=MMA), gl.zeros([128, 8], gl.float32, layout=MMA),
            gl.zeros([16, 8], gl.float32, layout=MMA))


@gluon.jit
def _overflowed(acc):
    """Whether the context holds an inf or NaN: FOLD's weights times a value scale or zero point past float16's
    range."""
    return gl.max(gl.max(gl.where(gl.abs(acc) < float("inf"), 0, 1), axis=1), axis=0) > 0


@gluon.jit
def _operands(q_row, FOLD: gl.constexpr):
    """The queries as the products take them (FOLD: also the raw keys' query by key group, its offset and the query
    summed per group) and the codes' selectors and shifts (`_keys`, `_values`)."""
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, B_OP))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
    if FOLD:  # every column scores the one query head, column 2 j + g over key group g's ranks
        q = gl.load(q_row + r[:, None] + 0 * c[None, :])
        channel = _key_channel(r)[:, None]
        q_own = gl.where(channel // 32 == (c % 2)[None, :], q, 0.0)  # over key group g's ranks
        q_fold = gl.where(channel % 2 == 1, q_own * 0.0625, q_own)  # the odd codes come at a shift of 4
        offset = gl.convert_layout(-1024.0 * gl.sum(q_fold.to(gl.float32), axis=0), gl.SliceLayout(0, MMA))
        offset = gl.zeros([16, 8], gl.float32, layout=MMA) + offset[None, :]
        sums0, sums1 = gl.split(gl.reshape(gl.convert_layout(gl.sum(q_own.to(gl.float32), axis=0),
                                                             gl.SliceLayout(0, MMA)), [4, 2]))
        sums0 = gl.convert_layout(sums0, gl.SliceLayout(0, SCORES))
        sums1 = gl.convert_layout(sums1, gl.SliceLayout(0, SCORES))
    else:
        q = gl.load(q_row + c[None, :] * 64 + r[:, None])
    # the prmt selector of each key word's group (words 0-3: the scale word's low half, 4-7: its high half)
    kwd = gl.arange(0, 8, layout=gl.SliceLayout(0, KEY_WORDS))
    selector = gl.expand_dims(gl.where(kwd >= 4, 0x3232, 0x1010), 0)
    lg = gl.arange(0, 8, layout=gl.SliceLayout(1, LANES))
    lt = gl.arange(0, 4, layout=gl.SliceLayout(0, LANES))
    v_shift = ((lg % 2) * 16)[:, None] + 0 * lt[None, :]
    # the prmt selector of a value block's scales in their word: blocks 0 and 2 the low halves, 1 and 3 the high
    v_selector = gl.where((lg // 2) % 2 == 1, 0x7632, 0x5410)[:, None] + 0 * lt[None, :]
    if FOLD:
        queries = (q, q_fold, offset, sums0, sums1)
    else:
        queries = (q,)
    return queries, (selector, v_shift, v_selector)


@gluon.jit
def _split(bufs, rows, q_row, on, shift, kw_ss: gl.constexpr, ks_ss: gl.constexpr, vw_ss: gl.constexpr,
           vs_ss: gl.constexpr, mask_ss: gl.constexpr, SINKS: gl.constexpr, HAS_MASK: gl.constexpr,
           FOLD: gl.constexpr):
    """The partials (maxima, sums, context, FOLD's column sums) of the split's slots [lo, hi) (`far_kernel`), the
    first tile's copies already issued into stage 0; weights 2^(score - max + shift)."""
    kw_s, ks_s, kz_s, va_s, vb_s, vs_s, vz_s = bufs
    lo, hi, last, split, n_far, h, kx_row, vx_row, mask_row, kx_ss, vx_ss, kept = on
    queries, codes = _operands(q_row, FOLD)
    selector, v_shift, v_selector = codes
    q = queries[0]
    if FOLD:
        q_fold, offset, sums0, sums1 = queries[1], queries[2], queries[3], queries[4]
    m_i, l_rows, acc, sums = _empty()
    slot = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    if SINKS > 0:
        if (split == 0) & (n_far > 0):
            keys, values = _exact_tile(kx_row, vx_row, kx_ss, vx_ss, h, SINKS)
            scores = mma_v2(keys, q, gl.zeros([16, 8], gl.float32, layout=MMA))
            scores = gl.where((slot < SINKS)[:, None], scores, -float("inf"))
            if HAS_MASK:
                scores = _masked(scores, mask_row, 0, slot, mask_ss)
            m_i = gl.max(scores, axis=0)
            l_rows = _ex2(scores - (_finite(m_i) - shift)[None, :])
            acc = mma_v2(values, gl.convert_layout(l_rows.to(gl.float16), B_OP), acc)
            if FOLD:  # every column, rows scaled as the folded context's are (taken back at the end), in float32
                ch = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
                acc = acc * (1 << _value_shift(ch)).to(gl.float32)[:, None]
    stage = 0
    for s0 in range(lo, hi, 64):
        async_copy.wait_group(0)
        _barrier()  # every lane's copies landed, and every lane is done reading the other stage
        _issue(bufs, rows, 1 - stage, gl.minimum(s0 + 64, last), kw_ss, ks_ss, vw_ss, vs_ss, FOLD)
        kw_t = kw_s.index(stage)
        ks_t = ks_s.index(stage)
        kz_t = kz_s.index(stage)
        if FOLD:
            sc0 = _folded_scores(kw_t, ks_t, kz_t, q_fold, offset, sums0, sums1, 0)
            sc1 = _folded_scores(kw_t, ks_t, kz_t, q_fold, offset, sums0, sums1, 16)
            sc2 = _folded_scores(kw_t, ks_t, kz_t, q_fold, offset, sums0, sums1, 32)
            sc3 = _folded_scores(kw_t, ks_t, kz_t, q_fold, offset, sums0, sums1, 48)
        else:
            sc0 = mma_v2(_keys(kw_t, ks_t, kz_t, 0, selector), q, gl.zeros([16, 8], gl.float32, layout=MMA))
            sc1 = mma_v2(_keys(kw_t, ks_t, kz_t, 16, selector), q, gl.zeros([16, 8], gl.float32, layout=MMA))
            sc2 = mma_v2(_keys(kw_t, ks_t, kz_t, 32, selector), q, gl.zeros([16, 8], gl.float32, layout=MMA))
            sc3 = mma_v2(_keys(kw_t, ks_t, kz_t, 48, selector), q, gl.zeros([16, 8], gl.float32, layout=MMA))
        if SINKS > 0:  # the sinks' codes: their exact copies came first
            sc0 = gl.where((s0 + slot >= SINKS)[:, None], sc0, -float("inf"))
        if HAS_MASK:
            if not kept:  # the split's slots are not all kept (a row's left padding)
                sc0 = _masked(sc0, mask_row, s0, slot, mask_ss)
                sc1 = _masked(sc1, mask_row, s0 + 16, slot, mask_ss)
                sc2 = _masked(sc2, mask_row, s0 + 32, slot, mask_ss)
                sc3 = _masked(sc3, mask_row, s0 + 48, slot, mask_ss)
        m_new = gl.maximum(m_i, gl.max(gl.maximum(gl.maximum(sc0, sc1), gl.maximum(sc2, sc3)), axis=0))
        m_use = m_new
        if HAS_MASK:  # no slot seen yet (m_new -inf): exponents against 0, not -inf - -inf
            m_use = _finite(m_new)
        alpha = _ex2(m_i - m_use)
        m_p = m_use - shift
        p0 = _ex2(sc0 - m_p[None, :])
        p1 = _ex2(sc1 - m_p[None, :])
        p2 = _ex2(sc2 - m_p[None, :])
        p3 = _ex2(sc3 - m_p[None, :])
        l_rows = l_rows * alpha[None, :] + ((p0 + p1) + (p2 + p3))
        m_i = m_new
        va_t = va_s.index(stage)
        vb_t = vb_s.index(stage)
        vs_t = vs_s.index(stage)
        if FOLD:
            acc, sums = _folded_tile(acc, sums, alpha, p0, p1, p2, p3, va_t, vb_t, vs_t, v_shift)
        else:
            acc = acc * alpha[None, :]
            vz_t = vz_s.index(stage)
            acc = mma_v2(_values(va_t, vb_t, vs_t, vz_t, 0, v_shift, v_selector),
                         gl.convert_layout(p0.to(gl.float16), B_OP), acc)
            acc = mma_v2(_values(va_t, vb_t, vs_t, vz_t, 16, v_shift, v_selector),
                         gl.convert_layout(p1.to(gl.float16), B_OP), acc)
            acc = mma_v2(_values(va_t, vb_t, vs_t, vz_t, 32, v_shift, v_selector),
                         gl.convert_layout(p2.to(gl.float16), B_OP), acc)
            acc = mma_v2(_values(va_t, vb_t, vs_t, vz_t, 48, v_shift, v_selector),
                         gl.convert_layout(p3.to(gl.float16), B_OP), acc)
        stage = 1 - stage
    async_copy.wait_group(0)
    return m_i, l_rows, acc, sums


@gluon.jit
def far_kernel(kw_ptr, ks_ptr, kz_ptr, vw_ptr, vs_ptr, vz_ptr, kx_ptr, vx_ptr, q_ptr, far_hi_ptr, mask_ptr, m_ptr,
               l_ptr, acc_ptr, kw_sb, kw_sh4, ks_sb, ks_sh, vw_sb, vw_sh4, vs_sb, vs_sh2, kx_sb, kx_ss, vx_sb, vx_ss,
               mask_sb, splits, row_splits, kw_ss: gl.constexpr, ks_ss: gl.constexpr, vw_ss: gl.constexpr,
               vs_ss: gl.constexpr, mask_ss: gl.constexpr, KV_HEADS: gl.constexpr, GROUP_HEADS: gl.constexpr,
               SINKS: gl.constexpr, HAS_MASK: gl.constexpr, FOLD: gl.constexpr):
    """Partials of split program_id(1) (of `splits`) of (batch row, KV head) program_id(0) over the slots [0, end) of
    its batch row b, all of them far (end: the least of far_hi_ptr[b * KV_HEADS + h] over its KV heads h, rounded
    down to a multiple of 64; `latent_decode.far_prep_kernel`'s firsts): written as the decode kernel writes its
    splits' (row (program_id(0) * row_splits + split) * GROUP_HEADS + query head of m_ptr, l_ptr: the running
    maximum in base 2 and the sum of 2^(score - m); of acc_ptr [rows, 128]: the latent context, unnormalized). The
    first SINKS slots (16 at most) come from their exact copies (kx_ptr, vx_ptr; their first rows), read by the
    first split. The codes, scales and zero points are read as int32 words (a slot's key scales: one word, its two
    groups; its value scales: two words), strides in words: the codes' head strides in units of four words (kw_sh4,
    vw_sh4) and the value scales' in units of two (vs_sh2), so that the copies know their alignment. q_ptr [rows * KV
    heads, 8 columns, 64 ranks] float16: the latent queries in the ranks' order (key_rank_channels), zero columns
    past the query heads of a KV head. HAS_MASK: a boolean mask over the slots (mask_ptr + b * mask_sb + slot *
    mask_ss, false: not attended; a row's left padding), whose splits may then see no slot (their maximum stays
    -inf, their sum 0). A split reads its slots' mask once, before its first tile (`_all_kept`), and its tiles read it
    again only where it drops one of them: a model's decode steps pass a mask, most rows have no padding, and read per
    tile it took the step at 4 far programs a multiprocessor from 0.107 to 0.127 ms (H100, Llama-3-8B shape, 16K,
    batch 16; docs/gpu-notes.md, "Stop 70"; "Stop 71" for the change).

    FOLD (one query head a KV head, `lowering.gluon_far.folds`; vs_ptr and vz_ptr then float16, their strides still
    in words) takes the scales and zero points out of the codes, into the columns of the products that the one query
    head leaves free. The key codes enter the scores' product unscaled (`_folded_scores`): its column 2 j + g holds
    the query over key group g's ranks, and each slot's group scales and zero points apply to its output. The value
    codes enter their product unscaled too, and its B operand holds in column n < 4 the weights times value group
    n's scale of each slot, in column 4 + n times its zero point. A product of a row of ones with the same operand
    sums each column over the slots, and each tile's product starts from -1024 times its column sums
    (`_folded_tile`), so the context of a channel of group n and shift s is (its column n) / 2^s + (the sum of
    column 4 + n), once at the end. The weights are 2^(score - max + FOLD_SHIFT), so that weights times scales stay
    normal float16; sums and context are scaled back at the end. Where a scale or zero point of 256 or more takes a
    product past float16's range, the split's context comes out inf or NaN, and the split is computed again from its
    first tile with weights 2^(score - max + SAFE_SHIFT) (a second copy of the loop, run by such splits only, so the
    first keeps its registers). The sinks' exact values enter unscaled, their product scaled in float32.
    Both save the two multiply-adds per pair of codes of their dequantizing (1,165 SASS instructions a tile -> 824).
    With more query heads a KV head there is no such room in the value product, and the scores' fold alone did not
    pay (docs/gpu-notes.md)."""
    gl.static_assert(GROUP_HEADS == 1 or not FOLD, "FOLD reads one query head a KV head (`gluon_far.folds`)")
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
    vs_unit = 2 if FOLD else 1  # elements a word of the value scales
    rows = (kw_ptr + b * kw_sb + h * (kw_sh4 * 4), ks_ptr + b * ks_sb + h * ks_sh, kz_ptr + b * ks_sb + h * ks_sh,
            vw_ptr + b * vw_sb + h * (vw_sh4 * 4), vs_ptr + (b * vs_sb + h * (vs_sh2 * 2)) * vs_unit,
            vz_ptr + (b * vs_sb + h * (vs_sh2 * 2)) * vs_unit)
    kw_s = gl.allocate_shared_memory(gl.int32, [2, 64, 8], SMEM2)
    ks_s = gl.allocate_shared_memory(gl.int32, [2, 64], SMEM1)
    kz_s = gl.allocate_shared_memory(gl.int32, [2, 64], SMEM1)
    va_s = gl.allocate_shared_memory(gl.int32, [2, 64, 8], SMEM2)
    vb_s = gl.allocate_shared_memory(gl.int32, [2, 64, 4], SMEM2)
    if FOLD:  # a slot's value scales, then its zero points
        vs_s = gl.allocate_shared_memory(gl.float16, [2, 64, 8], SMEM2)
        vz_s = vs_s
    else:
        vs_s = gl.allocate_shared_memory(gl.int32, [2, 64, 2], SMEM2)
        vz_s = gl.allocate_shared_memory(gl.int32, [2, 64, 2], SMEM2)
    bufs = (kw_s, ks_s, kz_s, va_s, vb_s, vs_s, vz_s)
    last = hi - 64  # a prefetch past the split's end reads its last tile again
    if hi > lo:  # an empty split reads nothing
        _issue(bufs, rows, 0, lo, kw_ss, ks_ss, vw_ss, vs_ss, FOLD)

    kept = gl.to_tensor(True)
    if HAS_MASK:  # read while the first tile's copies are under way
        kept = _all_kept(mask_ptr + b * mask_sb, lo, hi, mask_ss)
    on = (lo, hi, last, split, n_far, h, kx_ptr + b * kx_sb, vx_ptr + b * vx_sb, mask_ptr + b * mask_sb, kx_ss, vx_ss,
          kept)
    if FOLD:  # at FOLD_SHIFT, and again at SAFE_SHIFT where a product left float16's range (`_overflowed`)
        m_i, l_rows, acc, sums = _split(bufs, rows, q_ptr + bh * 512, on, FOLD_SHIFT, kw_ss, ks_ss, vw_ss, vs_ss,
                                        mask_ss, SINKS, HAS_MASK, FOLD)
        back = gl.to_tensor(2.0 ** -FOLD_SHIFT)
        if _overflowed(acc):
            _barrier()  # every lane is done reading the stages
            if hi > lo:
                _issue(bufs, rows, 0, lo, kw_ss, ks_ss, vw_ss, vs_ss, FOLD)
            m_i, l_rows, acc, sums = _split(bufs, rows, q_ptr + bh * 512, on, SAFE_SHIFT, kw_ss, ks_ss, vw_ss,
                                            vs_ss, mask_ss, SINKS, HAS_MASK, FOLD)
            back = gl.to_tensor(2.0 ** -SAFE_SHIFT)
    else:
        m_i, l_rows, acc, sums = _split(bufs, rows, q_ptr + bh * 512, on, 0.0, kw_ss, ks_ss, vw_ss, vs_ss, mask_ss,
                                        SINKS, HAS_MASK, FOLD)
        back = 1.0

    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    row = (bh * row_splits + split) * GROUP_HEADS + cols
    ok = cols < GROUP_HEADS
    gl.store(m_ptr + row, m_i, mask=ok)
    gl.store(l_ptr + row, gl.sum(l_rows, axis=0) * back, mask=ok)
    ch = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    if FOLD:  # row ch of value group n: its column n over 2^shift, plus the sum of column 4 + n
        group = (_value_channel(ch) // 32)[:, None]
        totals = gl.max(sums, axis=0)[None, :]  # a sum per column (the rows are alike)
        column = gl.sum(gl.where(cols[None, :] == group, acc, 0.0), axis=1)
        zeros = gl.sum(gl.where(cols[None, :] == group + 4, totals, 0.0), axis=1)
        unit = (1 << _value_shift(ch)).to(gl.float32)
        ctx = (column / unit + zeros) * back
        gl.store(acc_ptr + (bh * row_splits + split) * 128 + _value_channel(ch), ctx)
    else:
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
