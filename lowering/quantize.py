"""Reference quantization of latents: the CPU path and the oracle of the kernels that will read them.

Layout of one side's quantized latents (what `LatentCache` stores and kernels read), per sequence row b
and cache slot s:
- codes  uint8 [max_batch, slots, 2 * outliers + ceil((rank - outliers) * bits / 8)]: first the layout's
  `outliers` leading latent channels as float16 (2 bytes each, little-endian; not quantized: the top
  singular directions, STAR-KV's mixed precision), then the other channels' codes as one little-endian bit
  stream: code i occupies bits [i*bits, (i+1)*bits), least significant bit first (byte j holds bits
  [8j, 8j+8)). 8-bit codes are plain bytes; 4-bit ones two per byte, low nibble first. 3-bit codes are
  stored with the stream's 4-byte words reordered (`three_bit_order`): each whole block of 32 codes is 12
  bytes, three words, and in each unit of up to four consecutive whole blocks word j of every block comes
  before word j + 1 of any, so a reader takes the first, second and third words of a unit's blocks as three
  contiguous runs (the decode kernel's loads stay coalesced; word-interleaved, they took a fifth longer on the
  GPU). Bytes past the last whole block keep their place. Scales and zero points below cover the quantized
  channels only (rank - outliers of them).
- scale, zero  float16: asymmetric min/max quantization over each group of `group` values: value = code *
  scale + zero, code = round((value - zero) / scale) clamped to [0, 2^bits - 1], zero = the group's minimum.
  With q = rank - outliers quantized channels: per token (axis "token"): [max_batch, slots, q / group], a
  group = `group` consecutive latent channels of one slot. Per channel (axis "channel", KIVI's keys):
  [max_batch, ceil(slots / group), q], a group =
  one latent channel over the `group` slots of block s // group; a block is quantized when its last slot is
  written (its codes and scales are written then), and until then its slots are read from `exact`.
- exact  16-bit [max_batch, sinks + window, rank] (`exact_dtype`): the latents of the first `sinks` slots,
  then a ring of the most recent `window` slots, slot s at entry sinks + s % window. Every slot also has its
  quantized codes; a reader takes the exact copy where one is held. Empty when the layout keeps none.
16-bit sides are not quantized: latents are stored in the model's dtype; scale, zero and exact are empty.
Head-major storage (`by_blocks`): where a quantized side's factor is block diagonal (head- or group-wise) and each
block's codes and scales fill whole bytes and whole groups of their own (`stored_blocks`), `LatentCache` stores codes,
scales and zero points by block, [max_batch, blocks, slots, per block], so each KV head's slots lie in one run, and
hands the ops the view [max_batch, slots, blocks, per block]: the same bytes as the row of one slot, block by block
(each block's codes packed on their own equal its share of the row there). Every op reads a side's codes as either
[max_batch, slots, width] or that view (`rows_of` for the reference's reads); exact copies stay [max_batch,
sinks + window, rank].
Beside the sides, the cache holds one int32 [max_batch, slots] buffer of each slot's position, from which
RoPE is computed when keys are rebuilt (no per-slot cos/sin rows are stored).
"""
import functools

import torch

QUANTIZED_BITS = (8, 4, 3, 2)


def exact_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype exact (sink and window) latents are held in: the model's when it is 16-bit, else float16."""
    return model_dtype if model_dtype.itemsize == 2 else torch.float16


def packed_width(rank: int, bits: int) -> int:
    """Bytes one slot's codes take."""
    return -(-rank * bits // 8)


def three_bit_order(width: int, device=None) -> torch.Tensor:
    """int64 [width] on `device`: where each byte of a 3-bit code stream of `width` bytes is stored. Byte b lies in word
    j = (b % 12) // 4 of block k = b // 12 (32 codes); block k is block i = k % 4 of unit u = k // 4, which holds
    n = min(4, whole blocks - 4u) blocks; the word goes to word j * n + i of the unit (48 bytes from 48u). Bytes
    past the last whole block stay where they are. One block (or none) is the plain stream."""
    byte = torch.arange(width, device=device)  # built where the codes are: no copy from the host per write
    block, unit = byte // 12, byte // 48
    whole = width // 12
    blocks = (whole - 4 * unit).clamp(max=4)
    stored = 48 * unit + 4 * (((byte % 12) // 4) * blocks + block % 4) + byte % 4
    return torch.where(block < whole, stored, byte)


def _stored_order(width: int, device) -> torch.Tensor:
    """`three_bit_order(width)` where a 3-bit write or read takes it: kept per width on the CPU, where each layer
    and side of every step would build it again (a dozen small ops); built on the codes' device elsewhere, as a
    CUDA graph captures it."""
    if device.type == "cpu":
        return _cpu_three_bit_order(width)
    return three_bit_order(width, device)


@functools.cache
def _cpu_three_bit_order(width: int) -> torch.Tensor:
    return three_bit_order(width)


def _blocks_apart(bits: int, group: int, axis: str, outliers: int, block_rank: int) -> bool:
    """Whether a quantized side's blocks of `block_rank` latent channels can be stored apart (head-major): per-token
    scales whose groups divide the block, no outlier channels, and codes whose bytes split at the blocks' bounds,
    which at 3 bits needs whole units of `three_bit_order` (128 channels) per block."""
    return (bits != 16 and axis == "token" and not outliers and block_rank % group == 0
            and block_rank * bits % 8 == 0 and (bits != 3 or block_rank % 128 == 0))


def stored_blocks(bits: int, group: int, axis: str, outliers: int, rank: int, blocks: int) -> int:
    """The blocks a side of `rank` latent channels, a factor of `blocks` diagonal blocks, is stored in: the factor's
    where they can be stored apart (head-major), else 1 (rows)."""
    return blocks if blocks > 1 and _blocks_apart(bits, group, axis, outliers, rank // blocks) else 1


def by_blocks(rows: int, slots: int, width: int, blocks: int, dtype, device) -> torch.Tensor:
    """Zeros for `width` bytes or scales a slot as they are stored: rows [rows, slots, width] where `blocks` is 1,
    else head-major [rows, blocks, slots, width / blocks], handed as the ops read them: the view [rows, slots,
    blocks, width / blocks]."""
    if blocks == 1:
        return torch.zeros(rows, slots, width, dtype=dtype, device=device)
    return torch.zeros(rows, blocks, slots, width // blocks, dtype=dtype, device=device).transpose(1, 2)


def rows_of(tensor: torch.Tensor) -> torch.Tensor:
    """A side's codes, scales or zero points as rows [..., slots, width] (a copy where they are stored by blocks)."""
    return tensor.flatten(-2) if tensor.dim() == 4 else tensor


def like_stored(new: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Rows [..., width] of codes, scales or zero points shaped as `stored` holds them: split into its blocks where it
    is stored by blocks."""
    return new.unflatten(-1, stored.shape[-2:]) if stored.dim() == 4 else new


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., rank] (integers in [0, 2^bits)) -> uint8 [..., packed_width(rank, bits)].

    8-, 4- and 2-bit codes lie whole in their bytes: code i in byte i * bits // 8 from bit i * bits % 8. Eight 3-bit
    codes fill exactly 3 bytes, so that stream is built eight codes at a time (code i of a run in bits [3i, 3i + 3)
    of a little-endian 3-byte word) and then stored in `three_bit_order`."""
    rank = codes.shape[-1]
    if bits != 3:
        per_byte = 8 // bits
        padded = torch.nn.functional.pad(codes.to(torch.int32), (0, -rank % per_byte)).unflatten(-1, (-1, per_byte))
        shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
        return (padded << shifts).sum(-1, dtype=torch.int32).to(torch.uint8)
    runs = -(-rank // 8)
    padded = torch.nn.functional.pad(codes.to(torch.int32), (0, runs * 8 - rank)).unflatten(-1, (runs, 8))
    shifts = torch.arange(8, dtype=torch.int32, device=codes.device)  # 24-bit words: int32 holds them
    words = (padded << (bits * shifts)).sum(-1, dtype=torch.int32)  # [..., runs]
    stream = (words[..., None] >> (8 * shifts[:bits])) & 0xFF  # [..., runs, bits]
    stream = stream.flatten(-2)[..., :packed_width(rank, bits)].to(torch.uint8)
    stored = torch.empty_like(stream)
    stored[..., _stored_order(stream.shape[-1], stream.device)] = stream
    return stored


def unpack_codes(packed: torch.Tensor, bits: int, rank: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 [..., width] -> int32 [..., rank]. 8-, 4- and 2-bit codes lie whole in their
    bytes (code i in byte i * bits // 8 from bit i * bits % 8), so they are shifted out of each byte; 3-bit ones
    are read eight at a time from 3-byte words."""
    if bits != 3:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed[..., None] >> shifts) & (2 ** bits - 1)
        return codes.flatten(-2)[..., :rank].to(torch.int32)
    runs = -(-rank // 8)
    packed = packed[..., _stored_order(packed.shape[-1], packed.device)]
    stream = torch.nn.functional.pad(packed, (0, runs * bits - packed.shape[-1])).to(torch.int32)
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)  # 24-bit words: int32 holds them
    words = (stream.unflatten(-1, (runs, bits)) << (8 * shifts[:bits])).sum(-1, dtype=torch.int32)
    codes = (words[..., None] >> (bits * shifts)) & (2 ** bits - 1)
    return codes.flatten(-2)[..., :rank]


def _block_view(latent: torch.Tensor, group: int, axis: str) -> torch.Tensor:
    """float32 view of latent [..., tokens, rank] with the values of one scale along the last dimension: per token
    [..., tokens, rank / group, group]; per channel [..., blocks, rank, group] over blocks of `group` tokens (a
    last partial block padded with its own last token, which leaves its range as it is)."""
    latent = latent.float()
    if axis == "token":
        return latent.unflatten(-1, (-1, group))
    tokens = latent.shape[-2]
    padding = -tokens % group
    if padding:
        latent = torch.cat((latent, latent[..., -1:, :].expand(*latent.shape[:-2], padding, latent.shape[-1])), -2)
    return latent.unflatten(-2, (-1, group)).transpose(-1, -2)


def _channel_scales(scale: torch.Tensor, group: int, tokens: int) -> torch.Tensor:
    """float32 per-channel scale (or zero) [..., blocks, rank] spread to one per value [..., tokens, rank] (per-token
    scales broadcast over their groups instead)."""
    return scale.float().repeat_interleave(group, dim=-2)[..., :tokens, :]


def quantize(latent: torch.Tensor, bits: int, group: int, axis: str = "token", outliers: int = 0):
    """latent [..., tokens, rank] -> (codes uint8 [..., tokens, 2 * outliers + packed_width(rank - outliers, bits)],
    scale fp16, zero fp16). The first `outliers` channels are kept as float16 (their bytes lead each slot's
    codes); the rest are quantized, with scales [..., tokens, (rank - outliers) / group] per token and
    [..., ceil(tokens / group), rank - outliers] per channel."""
    kept, latent = latent[..., :outliers], latent[..., outliers:]
    blocks = _block_view(latent, group, axis)
    low, high = blocks.amin(-1), blocks.amax(-1)
    levels = 2 ** bits - 1
    scale = ((high - low) / levels).to(torch.float16)
    zero = low.to(torch.float16)
    # quantize against the stored (fp16) scale and zero, so dequantization reproduces the grid exactly
    if axis == "token":  # each group's scale and zero broadcast over its channels, not repeated
        step = scale.float()[..., None].clamp_min(2.0 ** -24)  # a constant group gets code 0
        codes = torch.round((blocks - zero.float()[..., None]) / step).clamp_(0, levels).flatten(-2)
    else:
        tokens = latent.shape[-2]
        step = _channel_scales(scale, group, tokens).clamp_min(2.0 ** -24)
        codes = torch.round((latent.float() - _channel_scales(zero, group, tokens)) / step).clamp_(0, levels)
    codes = pack_codes(codes, bits)
    if outliers:
        codes = torch.cat((kept.to(torch.float16).contiguous().view(torch.uint8), codes), dim=-1)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
               axis: str = "token", outliers: int = 0, dtype=torch.float32) -> torch.Tensor:
    """(codes, scale, zero) from `quantize` -> latent [..., tokens, rank] in `dtype`."""
    rank = scale.shape[-1] * (group if axis == "token" else 1)
    values = unpack_codes(codes[..., 2 * outliers:], bits, rank).float()
    if axis == "token":  # each group's scale broadcast over its channels, not repeated
        values = (values.unflatten(-1, (-1, group)) * scale.float()[..., None] + zero.float()[..., None]).flatten(-2)
    else:
        tokens = codes.shape[-2]
        values = values * _channel_scales(scale, group, tokens) + _channel_scales(zero, group, tokens)
    if outliers:
        values = torch.cat((_float16_from_bytes(codes[..., :2 * outliers]), values), dim=-1)
    return values.to(dtype)


def _float16_from_bytes(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2n] (little-endian float16s) -> float32 [..., n], whatever the strides of `raw`."""
    bits = raw[..., 0::2].to(torch.int32) | (raw[..., 1::2].to(torch.int32) << 8)
    return torch.where(bits >= 2 ** 15, bits - 2 ** 16, bits).to(torch.int16).view(torch.float16).float()


def fake_quantize(latent: torch.Tensor, bits: int, group: int, axis: str = "token", outliers: int = 0) -> torch.Tensor:
    """What a latent [..., tokens, rank] reads back as after a trip through the cache: dequantize(quantize(latent))."""
    if bits == 16:
        return latent
    return dequantize(*quantize(latent, bits, group, axis, outliers), bits, group, axis, outliers, dtype=latent.dtype)
