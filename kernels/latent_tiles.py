"""Reading one side of the latent cache inside a Triton kernel: a tile of slots x latent channels as the reference
op reads it (`lowering/reference.py`, layout in `lowering/quantize.py`): 16-bit latents, or packed codes unpacked
and dequantized with per-token or per-channel scales, float16 outlier channels, and the exact sink and window
copies where the cache holds them.
"""
import triton
import triton.language as tl


@triton.jit
def _as_float(codes):
    """int32 codes in [0, 2^23) to float32 exactly, without the slow int-to-float conversion."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


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
        at = codes_ptr + rows[:, None, None] + byte[None, :, :]
        ok = slot_ok[:, None, None]
        if EVEN:
            word = tl.load(at, mask=ok, other=0).to(tl.int32)
            word |= tl.load(at + 1, mask=ok, other=0).to(tl.int32) << 8
            word |= tl.load(at + 2, mask=ok, other=0).to(tl.int32) << 16
        else:
            word = tl.load(at, mask=ok & (byte < width)[None], other=0).to(tl.int32)
            word |= tl.load(at + 1, mask=ok & (byte + 1 < width)[None], other=0).to(tl.int32) << 8
            word |= tl.load(at + 2, mask=ok & (byte + 2 < width)[None], other=0).to(tl.int32) << 16
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
    at = codes_ptr + rows[:, None] + byte[None, :]
    codes = tl.load(at, mask=coded & (byte < width)[None, :], other=0).to(tl.int32)
    if BITS == 3:
        codes |= tl.load(at + 1, mask=coded & (byte + 1 < width)[None, :], other=0).to(tl.int32) << 8
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
def latent_tile(lat_ptr, lat_sb, lat_ss, scale_ptr, zero_ptr, sz_sb, sz_ss, exact_ptr, ex_sb, ex_ss,
                 b, first, slots, slot_ok, ch0, ch_hi, length, width, sinks, window,
                 BITS: tl.constexpr, GROUP: tl.constexpr, FAST: tl.constexpr, EXACT: tl.constexpr,
                 CHANNEL: tl.constexpr, OUTLIERS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr,
                 DTYPE: tl.constexpr, EVEN: tl.constexpr):
    """One side's latents [BLOCK_S, CHUNK] (channels ch0.. below ch_hi) of earlier steps' `slots` in DTYPE, as the
    reference reads them: dequantized codes, or the exact copy where the cache holds one.
    FAST: ch0 starts a whole byte (3-byte word for 3 bits) and GROUP divides it (see grouped_tile). EVEN: every
    channel of the chunk is below ch_hi, so only the slots are masked and the loads stay wide."""
    ch = ch0 + tl.arange(0, CHUNK)
    ch_ok = (ch >= 0) if EVEN else (ch < ch_hi)
    if BITS == 16:
        at = lat_ptr + b * lat_sb + slots[:, None] * lat_ss + ch[None, :]
        if EVEN:
            values = tl.load(at, mask=slot_ok[:, None], other=0.0).to(DTYPE)
        else:
            values = tl.load(at, mask=slot_ok[:, None] & ch_ok[None, :], other=0.0).to(DTYPE)
    elif FAST:
        values = grouped_tile(lat_ptr + b * lat_sb, slots * lat_ss, scale_ptr, zero_ptr, b * sz_sb + slots * sz_ss,
                               slot_ok, ch0, ch_hi, width, BITS, GROUP, CHUNK, BLOCK_S, DTYPE, EVEN)
    else:
        scale_rows = b * sz_sb + (slots // GROUP if CHANNEL else slots) * sz_ss
        values = gathered_tile(lat_ptr + b * lat_sb, slots * lat_ss, scale_ptr, zero_ptr, scale_rows, slot_ok, ch0,
                                ch_hi, width, BITS, GROUP, CHANNEL, OUTLIERS, CHUNK).to(DTYPE)
    if EXACT:
        if (first < sinks) | (first + BLOCK_S > length - 1 - window):
            in_window = slots >= length - window  # never below length - 1 when window is 0
            held = slot_ok & (slots < length - 1) & ((slots < sinks) | in_window)
            entry = tl.where(in_window, sinks + slots % tl.maximum(window, 1), slots)
            at = exact_ptr + b * ex_sb + entry[:, None] * ex_ss + ch[None, :]
            exact = tl.load(at, mask=held[:, None] & ch_ok[None, :], other=0.0).to(DTYPE)
            values = tl.where(held[:, None], exact, values)
    return values
