"""Triton latent write: both sides' new latents into the cache, quantized at write time, and the context check, in one
launch (the `@triton.jit` code only; the launcher is `lowering/triton_write.py`, the oracle `reference.latent_write`).

One program per (batch row, new token, side). A 16-bit side copies the latent to its slot. A quantized side (per-token
scales, groups of a multiple of 8 channels, no float16 outlier channels) reads the latent as runs of 8 channels,
[RUNS, 8]: 8 codes of `BITS` bits fill exactly `BITS` bytes, so each run packs into one little-endian word and
is stored as its bytes (`quantize.pack_codes`' stream; 3-bit bytes where `quantize.three_bit_order` puts them). A
group's scale and zero point come from its runs' min and max, rounded to float16 as the reference stores them, and
codes are rounded half to even against the stored float16 values (IEEE division), so the bytes equal the
reference's. Exact copies go where the reference keeps
them: sinks (index < sinks) and the ring of the last `window` indices of the write.
"""
import triton
import triton.language as tl

from .latent_tiles import three_bit_byte


@triton.jit
def _round_half_even(x):
    """x rounded to the nearest integer, ties to even (torch.round); exact for |x| < 2^22."""
    nearest = tl.floor(x + 0.5)
    return tl.where((nearest - x == 0.5) & (nearest - 2.0 * tl.floor(nearest * 0.5) == 1.0), nearest - 1.0, nearest)


@triton.jit
def _write_side(b, t, index, slot, new_ptr, new_sb, new_st, latent_ptr, lat_sb, lat_ss, lat_sk, scale_ptr, zero_ptr,
                sz_sb, sz_ss, sz_sk, exact_ptr, ex_sb, ex_ss, tokens, sinks, window, pos_ptr, pos_sb, new_pos_ptr,
                new_pos_sb, new_pos_st, RANK: tl.constexpr, RUNS: tl.constexpr, BITS: tl.constexpr,
                GROUP: tl.constexpr, STORED: tl.constexpr, HAS_EXACT: tl.constexpr, WRITE_POSITIONS: tl.constexpr):
    """Token t of row b into one side: sequence index `index`, slot `slot`. RUNS: a power of two >= RANK / 8. Codes
    stored by blocks (`quantize.by_blocks`, STORED: a block's channels) go to the block that holds them, lat_sk and
    sz_sk apart; STORED 0: rows (as latent_tiles.stored_block, a compile-time choice)."""
    run = tl.arange(0, RUNS)[:, None]
    channel = run * 8 + tl.arange(0, 8)[None, :]                                    # [RUNS, 8]
    inside = channel < RANK
    new = tl.load(new_ptr + b * new_sb + t * new_st + channel, mask=inside, other=0.0)
    if BITS == 16:
        tl.store(latent_ptr + b * lat_sb + slot * lat_ss + channel, new.to(latent_ptr.dtype.element_ty), mask=inside)
    else:
        RUNS_PER_GROUP: tl.constexpr = GROUP // 8
        LEVELS: tl.constexpr = (1 << BITS) - 1
        GROUPS: tl.constexpr = RUNS // RUNS_PER_GROUP
        # a stored block's scales and bytes where codes are stored by blocks (out of the loop below: Triton 3.6
        # refuses a constexpr assigned in each pass of a static_range)
        BLOCK_GROUPS: tl.constexpr = STORED // GROUP
        BLOCK_BYTES: tl.constexpr = STORED * BITS // 8
        value = new.to(tl.float32)
        grouped = tl.reshape(value, (GROUPS, RUNS_PER_GROUP * 8))
        # padded runs past RANK form whole groups of their own (RANK is a multiple of GROUP): they are not stored
        low = tl.min(grouped, 1)
        high = tl.max(grouped, 1)
        scale = tl.math.div_rn(high - low, tl.full(high.shape, LEVELS, tl.float32)).to(tl.float16)
        zero = low.to(tl.float16)
        group = tl.arange(0, GROUPS)
        row = b * sz_sb + slot * sz_ss + group
        if STORED:
            row += (group // BLOCK_GROUPS) * (sz_sk - BLOCK_GROUPS)
        tl.store(scale_ptr + row, scale, mask=group * GROUP < RANK)
        tl.store(zero_ptr + row, zero, mask=group * GROUP < RANK)
        step = tl.maximum(scale.to(tl.float32), 2.0 ** -24)[:, None]  # a constant group gets code 0
        codes = _round_half_even(tl.math.div_rn(grouped - zero.to(tl.float32)[:, None], step))
        codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS * 1.0).to(tl.int64)
        codes = tl.reshape(codes, (RUNS, 8))
        word = tl.sum(codes << (BITS * tl.arange(0, 8))[None, :].to(tl.int64), 1)   # [RUNS]: BITS bytes each
        at = latent_ptr + b * lat_sb + slot * lat_ss
        stored = tl.arange(0, RUNS) * 8 < RANK
        for byte in tl.static_range(BITS):
            place = tl.arange(0, RUNS) * BITS + byte
            if BITS == 3:  # where three_bit_order stores the stream's byte (within its block, where stored apart)
                place = three_bit_byte(place, RANK * 3 // 8)
            if STORED:
                place += (place // BLOCK_BYTES) * (lat_sk - BLOCK_BYTES)
            tl.store(at + place, ((word >> (8 * byte)) & 255).to(tl.uint8), mask=stored)
    if HAS_EXACT:
        copy = new.to(exact_ptr.dtype.element_ty)
        if index < sinks:
            tl.store(exact_ptr + b * ex_sb + index * ex_ss + channel, copy, mask=inside)
        if (window > 0) & (t >= tokens - window):
            tl.store(exact_ptr + b * ex_sb + (sinks + index % tl.maximum(window, 1)) * ex_ss + channel, copy,
                     mask=inside)
    if WRITE_POSITIONS:
        position = tl.load(new_pos_ptr + b * new_pos_sb + t * new_pos_st)
        tl.store(pos_ptr + b * pos_sb + index, position.to(pos_ptr.dtype.element_ty))


@triton.jit
def latent_write_kernel(k_new, k_new_sb, k_new_st, k_latent, k_lat_sb, k_lat_ss, k_lat_sk, k_scale, k_zero, k_sz_sb,
                        k_sz_ss, k_sz_sk, k_exact, k_ex_sb, k_ex_ss, k_sinks, k_window,
                        v_new, v_new_sb, v_new_st, v_latent, v_lat_sb, v_lat_ss, v_lat_sk, v_scale, v_zero, v_sz_sb,
                        v_sz_ss, v_sz_sk, v_exact, v_ex_sb, v_ex_ss, v_sinks, v_window,
                        length_ptr, tokens, slots, capacity, room_ptr, pos_ptr, pos_sb, new_pos_ptr, new_pos_sb,
                        new_pos_st,
                        K_RANK: tl.constexpr, K_RUNS: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                        K_STORED: tl.constexpr, K_HAS_EXACT: tl.constexpr,
                        V_RANK: tl.constexpr, V_RUNS: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                        V_STORED: tl.constexpr, V_HAS_EXACT: tl.constexpr, WRITE_POSITIONS: tl.constexpr):
    """One program per (batch row, new token, side: 0 keys, 1 values); token t of row b is sequence index length + t,
    slot index % slots (a ring where slots < capacity). The context check is here too: where length + tokens passes
    the capacity (the positions' slots) nothing is written, and program (0, 0, 0) stores whether it fits at room_ptr
    for the launcher's device assertion (one launch for both sides and the check, where there were two launches and
    a comparison)."""
    b, t, side = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(length_ptr).to(tl.int32)
    fits = length <= capacity - tokens
    if (b == 0) & (t == 0) & (side == 0):
        tl.store(room_ptr, fits.to(tl.int8))
    if fits:
        index = length + t
        slot = index % slots
        if side == 0:
            _write_side(b, t, index, slot, k_new, k_new_sb, k_new_st, k_latent, k_lat_sb, k_lat_ss, k_lat_sk, k_scale,
                        k_zero, k_sz_sb, k_sz_ss, k_sz_sk, k_exact, k_ex_sb, k_ex_ss, tokens, k_sinks, k_window,
                        pos_ptr, pos_sb, new_pos_ptr, new_pos_sb, new_pos_st, K_RANK, K_RUNS, K_BITS, K_GROUP,
                        K_STORED, K_HAS_EXACT, WRITE_POSITIONS)
        else:
            _write_side(b, t, index, slot, v_new, v_new_sb, v_new_st, v_latent, v_lat_sb, v_lat_ss, v_lat_sk, v_scale,
                        v_zero, v_sz_sb, v_sz_ss, v_sz_sk, v_exact, v_ex_sb, v_ex_ss, tokens, v_sinks, v_window,
                        pos_ptr, pos_sb, new_pos_ptr, new_pos_sb, new_pos_st, V_RANK, V_RUNS, V_BITS, V_GROUP,
                        V_STORED, V_HAS_EXACT, False)
