"""Reading one side of the latent cache inside a Triton kernel: a tile of slots x latent channels as the reference
op reads it (`lowering/reference.py`, layout in `lowering/quantize.py`): 16-bit latents, or packed codes unpacked
and dequantized with per-token or per-channel scales, float16 outlier channels, and the exact sink and window
copies where the cache holds them.
"""
import struct

import triton
import triton.language as tl


def _half2(value: float) -> str:
    """A float16 constant twice over, as a PTX .b32 immediate."""
    bits = struct.unpack("<H", struct.pack("<e", value))[0]
    return f"0x{bits:04x}{bits:04x}"


def _pair_asm(selectors, shifts, bits) -> str:
    """PTX turning codes into float16 latents two at a time: per output pair, the bytes holding one code of each of
    two words sit in the two 16-bit halves of a register (prmt with `selectors` over two int32 inputs; with none,
    codes i and i + 4 of one int32 word of 4-bit codes, the last two pairs after a shift by 8 bits), lop3 masks
    the code (at bit `shift` of its half) into the mantissa of 1024, an exact fma takes 1024 away and divides by
    2^shift, and a last fma applies scale and zero point (float16 inputs after the words). Outputs float16."""
    outputs = 2 * len(shifts)
    words = 2 if selectors else 1
    scale = outputs + words
    lines = [f"mov.b32 s2, {{${scale}, ${scale}}};", f"mov.b32 z2, {{${scale + 1}, ${scale + 1}}};"]
    if not selectors:
        lines.append(f"shr.u32 hi, ${outputs}, 8;")
    gathered = None
    for pair, shift in enumerate(shifts):
        if selectors:
            if selectors[pair] != gathered:
                lines.append(f"prmt.b32 w, ${outputs}, ${outputs + 1}, {selectors[pair]:#06x};")
                gathered = selectors[pair]
            source = "w"
        else:
            source = f"${outputs}" if pair < 2 else "hi"
        mask = ((1 << bits) - 1) << shift
        lines.append(f"lop3.b32 t, {source}, {mask | mask << 16:#010x}, 0x64006400, 0xea;")
        lines.append(f"fma.rn.f16x2 t, t, m{shift}, a{shift};")
        lines.append("fma.rn.f16x2 t, t, s2, z2;")
        lines.append(f"mov.b32 {{${2 * pair}, ${2 * pair + 1}}}, t;")
    constants = [f"mov.b32 m{shift}, {_half2(2.0 ** -shift)};\nmov.b32 a{shift}, {_half2(-1024.0 * 2.0 ** -shift)};"
                 for shift in sorted(set(shifts))]  # f16x2 operands are registers
    names = ", ".join(f"m{shift}, a{shift}" for shift in sorted(set(shifts)))
    return "{\n.reg .b32 s2, z2, t, w, hi, " + names + ";\n" + "\n".join(constants + lines) + "\n}"


def _three_bit_asm(first_word: int) -> str:
    """Codes of two 3-bit words (24 bits each) at byte offsets first_word and first_word + 3 of the 8 bytes of two
    int32 inputs: output pair i holds code i of both."""
    selectors, shifts = [], []
    for code in range(8):
        byte, shift = divmod(3 * code, 8)
        picks = [first_word + byte, first_word + byte + 1, first_word + 3 + byte, first_word + 3 + byte + 1]
        picks = [min(pick, 7) for pick in picks]  # a code in a word's last byte needs no byte past it
        selectors.append(picks[0] | picks[1] << 4 | picks[2] << 8 | picks[3] << 12)
        shifts.append(shift)
    return _pair_asm(selectors, shifts, 3)


# 8 codes of one int32 word of 4-bit codes: pairs (i, i + 4), i = 0..3, the second two after a shift by 8 bits
FOUR_BIT_ASM = tl.constexpr(_pair_asm([], [0, 4, 0, 4], 4))
# the 32 codes of 12 bytes (three int32 words) of 3-bit codes: words 0 and 1 from ints 0-1, words 2 and 3 from 1-2
THREE_BIT_ASM_LO = tl.constexpr(_three_bit_asm(0))
THREE_BIT_ASM_HI = tl.constexpr(_three_bit_asm(2))


@triton.jit
def _as_float(codes):
    """int32 codes in [0, 2^23) to float32 exactly, without the slow int-to-float conversion."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def three_bit_byte(byte, width):
    """Where byte `byte` of a 3-bit code stream of `width` bytes is stored (`quantize.three_bit_order`)."""
    block = byte // 12
    unit = byte // 48
    whole = width // 12
    blocks = tl.minimum(whole - 4 * unit, 4)
    stored = 48 * unit + 4 * (((byte % 12) // 4) * blocks + block % 4) + byte % 4
    return tl.where(block < whole, stored, byte)


@triton.jit
def grouped_tile(codes_ptr, rows, scale_ptr, zero_ptr, scale_rows, slot_ok, ch0, ch_hi, width,
                  BITS: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr,
                  DTYPE: tl.constexpr, EVEN: tl.constexpr):
    """Latents [BLOCK_S, CHUNK] of channels ch0.. (ch0, CHUNK and ch_hi multiples of GROUP, a power of two) from
    codes (rows: each slot's byte offset): each group's bytes are contiguous, so they load as [slots, groups,
    bytes] tiles, split into codes and dequantized with the group's scale broadcast, then tl.join interleaves the
    codes of a byte (or 3-byte word). tl.join adds the minor axis: code i lands at flat index i when the outer
    join pairs even and odd codes and the inner ones codes i and i + 2 (i + 4 for 8 codes). Groups at or past
    ch_hi get scale and zero 0, so their values are 0 (EVEN: none is)."""
    GROUPS: tl.constexpr = CHUNK // GROUP
    group = ch0 // GROUP + tl.arange(0, GROUPS)
    if EVEN:
        ok = slot_ok[:, None] & (group >= 0)[None, :]
    else:
        ok = slot_ok[:, None] & (group * GROUP < ch_hi)[None, :]
    scale = tl.load(scale_ptr + scale_rows[:, None] + group[None, :], mask=ok, other=0.0).to(tl.float32)[:, :, None]
    zero = tl.load(zero_ptr + scale_rows[:, None] + group[None, :], mask=ok, other=0.0).to(tl.float32)[:, :, None]
    if BITS == 3:
        WORDS: tl.constexpr = GROUP // 8
        byte = (group[:, None] * WORDS + tl.arange(0, WORDS)[None, :]) * 3            # [GROUPS, WORDS]
        at = codes_ptr + rows[:, None, None]
        ok = slot_ok[:, None, None]
        word = tl.zeros(ok.shape, tl.int32)
        for k in tl.static_range(3):  # each byte where three_bit_order stores it
            inside = ok
            if not EVEN:
                inside = ok & (byte + k < width)[None]
            stored = three_bit_byte(byte + k, width)[None, :, :]
            word |= tl.load(at + stored, mask=inside, other=0).to(tl.int32) << (8 * k)
        even = tl.join(tl.join(_dequant(word & 7, scale, zero, DTYPE),
                               _dequant((word >> 12) & 7, scale, zero, DTYPE)),
                       tl.join(_dequant((word >> 6) & 7, scale, zero, DTYPE),
                               _dequant((word >> 18) & 7, scale, zero, DTYPE)))
        odd = tl.join(tl.join(_dequant((word >> 3) & 7, scale, zero, DTYPE),
                              _dequant((word >> 15) & 7, scale, zero, DTYPE)),
                      tl.join(_dequant((word >> 9) & 7, scale, zero, DTYPE),
                              _dequant(word >> 21, scale, zero, DTYPE)))
        values = tl.join(even, odd)
    else:
        BYTES: tl.constexpr = GROUP * BITS // 8
        byte = group[:, None] * BYTES + tl.arange(0, BYTES)[None, :]                   # [GROUPS, BYTES]
        if EVEN:
            raw = tl.load(codes_ptr + rows[:, None, None] + byte[None, :, :], mask=slot_ok[:, None, None],
                          other=0).to(tl.int32)
        else:
            raw = tl.load(codes_ptr + rows[:, None, None] + byte[None, :, :],
                          mask=slot_ok[:, None, None] & (byte < width)[None], other=0).to(tl.int32)
        if BITS == 8:
            values = _dequant(raw, scale, zero, DTYPE)
        elif BITS == 4:
            values = tl.join(_dequant(raw & 15, scale, zero, DTYPE), _dequant(raw >> 4, scale, zero, DTYPE))
        else:
            values = tl.join(tl.join(_dequant(raw & 3, scale, zero, DTYPE),
                                     _dequant((raw >> 4) & 3, scale, zero, DTYPE)),
                             tl.join(_dequant((raw >> 2) & 3, scale, zero, DTYPE),
                                     _dequant(raw >> 6, scale, zero, DTYPE)))
    return tl.reshape(values, (BLOCK_S, CHUNK))


@triton.jit
def _flat8(o0, o1, o2, o3, o4, o5, o6, o7):
    """[..., 2, 2, 2] holding o_j at flat index j (tl.join adds the minor axis: the outer join takes the even and
    odd j)."""
    return tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))


@triton.jit
def _flat16(o):
    """[..., 2, 2, 2, 2] holding o[j] at flat index j."""
    return tl.join(_flat8(o[0], o[2], o[4], o[6], o[8], o[10], o[12], o[14]),
                   _flat8(o[1], o[3], o[5], o[7], o[9], o[11], o[13], o[15]))


@triton.jit
def packed_order(CHUNK: tl.constexpr, BITS: tl.constexpr):
    """[CHUNK] the channel (counted from the chunk's first) each column of packed_tile holds. A register's two
    float16 latents stay side by side, as dot operands take them, so the columns are permuted: at 4 bits (codes
    i and i + 4 of a word in a register) so that each thread of the key product's operand holds whole words of
    its own, at 3 bits within each 32 channels (code i of words 0 and 1, then of words 2 and 3)."""
    j = tl.arange(0, CHUNK)
    if BITS == 4:  # column 32 u + 8 i + 2 t + e: channel 8 (t CHUNK / 32 + u) + i + 4 e
        return 8 * (((j >> 1) & 3) * (CHUNK // 32) + (j >> 5)) + ((j >> 3) & 3) + 4 * (j & 1)
    return (j & ~31) + 16 * ((j & 31) >> 4) + 8 * (j & 1) + ((j & 15) >> 1)


@triton.jit
def packed_scales(scale_ptr, zero_ptr, scale_rows, slot_ok, ch0, ch_hi, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                  EVEN: tl.constexpr):
    """float16 (scales, zero points) [BLOCK_S, CHUNK // GROUP] of packed_tile's groups (0 for groups at or past
    ch_hi)."""
    group = ch0 // GROUP + tl.arange(0, CHUNK // GROUP)
    ok = slot_ok[:, None] & ((group >= 0) if EVEN else (group * GROUP < ch_hi))[None, :]
    at = scale_rows[:, None] + group[None, :]
    return (tl.load(scale_ptr + at, mask=ok, other=0.0).to(tl.float16),
            tl.load(zero_ptr + at, mask=ok, other=0.0).to(tl.float16))


@triton.jit
def packed_tile(codes_ptr, rows, scale_ptr, zero_ptr, scale_rows, slot_ok, ch0, ch_hi, width,
                BITS: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr,
                EVEN: tl.constexpr, scale=None, zero=None):
    """float16 latents [BLOCK_S, CHUNK] of channels ch0 + packed_order (ch0, CHUNK and ch_hi multiples of GROUP,
    itself a multiple of 8 for 4 bits, of 32 for 3; CHUNK of 32; at 3 bits, ch0 and the row's rank multiples of
    CHUNK, so that the chunk's blocks lie in one unit of `quantize.three_bit_order`; width: a slot's bytes), from
    codes read as int32 words (rows: each slot's byte offset, a multiple of 4) and dequantized two at a time in
    float16 registers (FOUR_BIT_ASM, THREE_BIT_ASM_*). Exact where the reference's float32 result rounds to the
    same float16, as codes and float16 scales make likely. scale, zero: the groups' (packed_scales), where the
    caller loaded them ahead."""
    GROUPS: tl.constexpr = CHUNK // GROUP
    words_ptr = codes_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    group = ch0 // GROUP + tl.arange(0, GROUPS)
    ok = slot_ok[:, None] & ((group >= 0) if EVEN else (group * GROUP < ch_hi))[None, :]
    if scale is None:
        scale, zero = packed_scales(scale_ptr, zero_ptr, scale_rows, slot_ok, ch0, ch_hi, GROUP, CHUNK, EVEN)
    scale, zero = scale[:, :, None], zero[:, :, None]
    ok = ok[:, :, None]
    if BITS == 4:  # thread t of a dot operand's 4 takes channel pairs 2t, 2t + 1 mod 8: whole words of its own
        WORDS: tl.constexpr = CHUNK // 32
        # the chunk's CHUNK // 8 words of a slot are contiguous: loaded flat, a slot's sector at a time (a load
        # shaped [slots, 4, WORDS] took the dot's layout, each thread a word pair of another slot), then split
        word = ch0 // 8 + tl.arange(0, CHUNK // 8)
        ok = slot_ok[:, None] & ((word >= 0) if EVEN else (word * 8 < ch_hi))[None, :]
        codes = tl.load(words_ptr + (rows // 4)[:, None] + word[None, :], mask=ok, other=0)
        codes = tl.reshape(codes, (BLOCK_S, 4, WORDS))
        # each group's scale over its GROUP / 8 words
        scale = tl.reshape(tl.broadcast_to(scale, (BLOCK_S, GROUPS, GROUP // 8)), codes.shape)
        zero = tl.reshape(tl.broadcast_to(zero, (BLOCK_S, GROUPS, GROUP // 8)), codes.shape)
        out = tl.inline_asm_elementwise(FOUR_BIT_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [codes, scale, zero],
                                        dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        # [slots, 4 (t), WORDS (u), 2, 2 (pair i), 2 (e)] -> column 32 u + 8 i + 2 t + e
        values = tl.permute(_flat8(out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7]),
                            (0, 2, 3, 4, 1, 5))
    else:
        BLOCKS: tl.constexpr = GROUP // 32  # 32 codes in 12 bytes, three int32 words
        # the chunk's blocks lie in one unit of three_bit_order: the unit's first words of its n blocks, then
        # their second words, then their third. The hints hold as the launcher's PACKED asks: the chunk's
        # CHUNK // 32 blocks start at a multiple of their count, and the row's whole blocks are a multiple of it
        # too, so is n
        block = ch0 // 32
        unit = block // 4
        if CHUNK == 128:  # the whole unit, from its first block
            n, first_block = 4, 0
        else:
            n = tl.multiple_of(tl.minimum(width // 12 - 4 * unit, 4), CHUNK // 32)
            first_block = tl.multiple_of(block % 4, CHUNK // 32)
        word = 12 * unit + first_block + (tl.arange(0, GROUPS)[:, None] * BLOCKS + tl.arange(0, BLOCKS)[None, :])
        at = words_ptr + (rows // 4)[:, None, None] + word[None, :, :]
        first = tl.load(at, mask=ok, other=0)
        middle = tl.load(at + n, mask=ok, other=0)
        last = tl.load(at + 2 * n, mask=ok, other=0)
        shape: tl.constexpr = first.shape
        scale = tl.broadcast_to(scale, shape)
        zero = tl.broadcast_to(zero, shape)
        low = tl.inline_asm_elementwise(THREE_BIT_ASM_LO, "=h," * 16 + "r,r,h,h", [first, middle, scale, zero],
                                        dtype=(tl.float16,) * 16, is_pure=True, pack=1)
        high = tl.inline_asm_elementwise(THREE_BIT_ASM_HI, "=h," * 16 + "r,r,h,h", [middle, last, scale, zero],
                                         dtype=(tl.float16,) * 16, is_pure=True, pack=1)
        # [.., 16 (2, 2, 2, 2), 2] -> the words 0-1 block before the words 2-3 block
        values = tl.permute(tl.join(_flat16(low), _flat16(high)), (0, 1, 2, 7, 3, 4, 5, 6))
    return tl.reshape(values, (BLOCK_S, CHUNK))


@triton.jit
def _dequant(codes, scale, zero, DTYPE: tl.constexpr):
    return (_as_float(codes) * scale + zero).to(DTYPE)


@triton.jit
def gathered_tile(codes_ptr, rows, scale_ptr, zero_ptr, scale_rows, slot_ok, ch0, ch_hi, width,
                   BITS: tl.constexpr, GROUP: tl.constexpr, CHANNEL: tl.constexpr, OUTLIERS: tl.constexpr,
                   CHUNK: tl.constexpr):
    """float32 latents [BLOCK_S, CHUNK] of channels ch0.. below ch_hi, any alignment and group: each channel
    gathers its byte (and the next, where 3-bit codes straddle two) and its scale: column q // GROUP of the
    slot's scale row, or column q of its block's row (CHANNEL: scale_rows already index slot // GROUP), for the
    q-th quantized channel. The first OUTLIERS channels are float16 at the head of each row (two bytes each,
    read bytewise: rows need not be 2-byte aligned) and the codes' bit stream follows them."""
    ch = ch0 + tl.arange(0, CHUNK)
    ok = slot_ok[:, None] & (ch < ch_hi)[None, :]
    quantized = tl.maximum(ch - OUTLIERS, 0)
    coded = ok & (ch >= OUTLIERS)[None, :]
    bit = quantized * BITS
    byte = 2 * OUTLIERS + bit // 8
    at = codes_ptr + rows[:, None]
    stored = byte
    if BITS == 3:  # the stream's bytes where three_bit_order stores them
        stored = 2 * OUTLIERS + three_bit_byte(bit // 8, width - 2 * OUTLIERS)
    codes = tl.load(at + stored[None, :], mask=coded & (byte < width)[None, :], other=0).to(tl.int32)
    if BITS == 3:
        stored = 2 * OUTLIERS + three_bit_byte(bit // 8 + 1, width - 2 * OUTLIERS)
        codes |= tl.load(at + stored[None, :], mask=coded & (byte + 1 < width)[None, :], other=0).to(tl.int32) << 8
    codes = (codes >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
    column = quantized if CHANNEL else quantized // GROUP
    scale = tl.load(scale_ptr + scale_rows[:, None] + column[None, :], mask=coded, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + scale_rows[:, None] + column[None, :], mask=coded, other=0.0).to(tl.float32)
    values = tl.where(coded, _as_float(codes) * scale + zero, 0.0)
    if OUTLIERS > 0:
        kept = ok & (ch < OUTLIERS)[None, :]
        at = codes_ptr + rows[:, None] + 2 * ch[None, :]
        half = tl.load(at, mask=kept, other=0).to(tl.int32) | (tl.load(at + 1, mask=kept, other=0).to(tl.int32) << 8)
        half = half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        values = tl.where(kept, half, values)
    return values


@triton.jit
def stored_block(side, b, ch0, BITS: tl.constexpr, GROUP: tl.constexpr, STORED: tl.constexpr):
    """(codes' offset, scales' offset, bytes before) of row b's stored block that holds channel ch0. STORED: a
    block's latent channels where the side is stored by blocks (`quantize.by_blocks`), each offset then moved back by
    the blocks before it (their bytes of codes, their groups) so that the block's channels are read at their own
    numbers, as in a row, and bytes before: what a mask against the block's width in bytes must add to it; 0 for
    rows, whose offsets are the row's alone. A compile-time choice: rows compile as before blocks existed (with a
    block offset that was 0 at run time, the 3-bit float16 path of packed_tile read wrong values on an H200, Triton
    3.6), and the blocks' offsets keep the alignment their constant widths give."""
    _, lat_sb, _, lat_sk, _, _, sz_sb, _, sz_sk, _, _, _, _, _, _ = side  # see latent_tile
    if STORED:
        BYTES: tl.constexpr = STORED * BITS // 8
        GROUPS: tl.constexpr = STORED // GROUP
        block = ch0 // STORED
        codes_at = b * lat_sb + block * (lat_sk - BYTES)
        scale_at = b * sz_sb + block * (sz_sk - GROUPS)
        before = block * BYTES
    else:
        codes_at = b * lat_sb
        scale_at = b * sz_sb
        before = 0
    return codes_at, scale_at, before


@triton.jit
def packed_scales_at(side, b, slots, slot_ok, ch0, ch_hi, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                     EVEN: tl.constexpr, STORED: tl.constexpr):
    """packed_scales of one side's channels ch0.. below ch_hi at `slots` of row b (see latent_tile)."""
    _, _, _, _, scale_ptr, zero_ptr, _, sz_ss, _, _, _, _, _, _, _ = side
    _, scale_at, _ = stored_block(side, b, ch0, 1, GROUP, STORED)
    return packed_scales(scale_ptr, zero_ptr, scale_at + slots * sz_ss, slot_ok, ch0, ch_hi, GROUP, CHUNK, EVEN)


@triton.jit
def _read_tile(side, b, first, slots, slot_ok, ch, ch_ok, ch0, ch_hi, BITS: tl.constexpr, GROUP: tl.constexpr,
               FAST: tl.constexpr, CHANNEL: tl.constexpr, OUTLIERS: tl.constexpr, CHUNK: tl.constexpr,
               BLOCK_S: tl.constexpr, DTYPE: tl.constexpr, EVEN: tl.constexpr, PACKED: tl.constexpr,
               STORED: tl.constexpr, scale=None, zero=None, desc=None):
    """The cache's latents [BLOCK_S, CHUNK] of `slots` (columns `ch`) in DTYPE: 16-bit, or codes dequantized."""
    lat_ptr, lat_sb, lat_ss, _, scale_ptr, zero_ptr, _, sz_ss, _, _, _, _, width, _, _ = side  # see latent_tile
    if desc is not None:  # a whole tile of 16-bit latents, by the tensor memory accelerator (see latent_tile)
        values = tl.reshape(desc.load([b, first, ch0]), (BLOCK_S, CHUNK)).to(DTYPE)
    elif BITS == 16:
        at = lat_ptr + b * lat_sb + slots[:, None] * lat_ss + ch[None, :]
        if EVEN:
            values = tl.load(at, mask=slot_ok[:, None], other=0.0).to(DTYPE)
        else:
            values = tl.load(at, mask=slot_ok[:, None] & ch_ok[None, :], other=0.0).to(DTYPE)
    else:  # codes: from their stored block (a tile's all lie in one: _side)
        codes_at, scale_at, before = stored_block(side, b, ch0, BITS, GROUP, STORED)
        codes_ptr, rows = lat_ptr + codes_at, slots * lat_ss
        if PACKED:  # the row's width: packed_tile reads it only at 3 bits in chunks below 128, never stored by blocks
            values = packed_tile(codes_ptr, rows, scale_ptr, zero_ptr, scale_at + slots * sz_ss, slot_ok, ch0, ch_hi,
                                 width, BITS, GROUP, CHUNK, BLOCK_S, EVEN, scale, zero)
        elif FAST:
            values = grouped_tile(codes_ptr, rows, scale_ptr, zero_ptr, scale_at + slots * sz_ss, slot_ok, ch0,
                                  ch_hi, before + width, BITS, GROUP, CHUNK, BLOCK_S, DTYPE, EVEN)
        else:
            scale_rows = scale_at + (slots // GROUP if CHANNEL else slots) * sz_ss
            values = gathered_tile(codes_ptr, rows, scale_ptr, zero_ptr, scale_rows, slot_ok, ch0, ch_hi,
                                   before + width, BITS, GROUP, CHANNEL, OUTLIERS, CHUNK).to(DTYPE)
    return values


@triton.jit
def latent_tile(side, b, first, slots, slot_ok, ch0, ch_hi, length,
                BITS: tl.constexpr, GROUP: tl.constexpr, FAST: tl.constexpr, EXACT: tl.constexpr,
                CHANNEL: tl.constexpr, OUTLIERS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr,
                DTYPE: tl.constexpr, EVEN: tl.constexpr, PACKED: tl.constexpr, STORED: tl.constexpr, scale=None,
                zero=None, desc=None):
    """One side's latents [BLOCK_S, CHUNK] (channels ch0.. below ch_hi) of earlier steps' `slots` in DTYPE, as the
    reference reads them: dequantized codes, or the exact copy where the cache holds one.
    side: one side of the cache as the kernels bundle their arguments: (latents, their batch, slot and block
    strides, scales, zero points, their batch, slot and block strides, exact copies, their batch and slot strides,
    the width of a slot's stored block in bytes of codes or channels, sinks, window). STORED: a block's latent
    channels where codes are stored by blocks (`quantize.by_blocks`), read from the block that holds ch0, which holds
    the whole chunk (stored_block); 0 for rows (block strides unused).
    FAST: ch0 starts a whole byte (3-byte word for 3 bits) and GROUP divides it (see grouped_tile). PACKED: float16
    latents from int32 words (packed_tile), columns in packed_order; scale, zero: its groups' scales and zero
    points where the caller loaded them ahead (packed_scales). EVEN: every channel of the chunk is below
    ch_hi, so only the slots are masked and the loads stay wide. desc: 16-bit latents as a tensor descriptor
    [batch, slots, width] with blocks [1, BLOCK_S, CHUNK], for a tile whose slots `first`.. are all cached slots
    (the caller masks those it does not score) and whose channels are all below ch_hi: loaded whole into shared
    memory by the tensor memory accelerator, unmasked (None: pointer loads).
    A tile holding exact copies (sinks, window) reads its codes again inside its branch, for the slots it does not
    hold: the tiles without any then take the codes straight into the layout their dot wants."""
    if PACKED:
        ch = ch0 + packed_order(CHUNK, BITS)
    else:
        ch = ch0 + tl.arange(0, CHUNK)
    ch_ok = (ch >= 0) if EVEN else (ch < ch_hi)
    values = _read_tile(side, b, first, slots, slot_ok, ch, ch_ok, ch0, ch_hi, BITS, GROUP, FAST, CHANNEL, OUTLIERS,
                        CHUNK, BLOCK_S, DTYPE, EVEN, PACKED, STORED, scale, zero, desc)
    if EXACT:
        _, _, _, _, _, _, _, _, _, exact_ptr, ex_sb, ex_ss, _, sinks, window = side
        if (first < sinks) | (first + BLOCK_S > length - 1 - window):
            in_window = slots >= length - window  # never below length - 1 when window is 0
            held = slot_ok & (slots < length - 1) & ((slots < sinks) | in_window)
            entry = tl.where(in_window, sinks + slots % tl.maximum(window, 1), slots)
            at = exact_ptr + b * ex_sb + entry[:, None] * ex_ss + ch[None, :]
            exact = tl.load(at, mask=held[:, None] & ch_ok[None, :], other=0.0).to(DTYPE)
            coded = _read_tile(side, b, first, slots, slot_ok & ~held, ch, ch_ok, ch0, ch_hi, BITS, GROUP, FAST,
                               CHANNEL, OUTLIERS, CHUNK, BLOCK_S, DTYPE, EVEN, PACKED, STORED)
            values = tl.where(held[:, None], exact, coded)
    return values
