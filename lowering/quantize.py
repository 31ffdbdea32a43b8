"""Reference quantization of latents: the CPU path and the oracle of the kernels that will read them.

Layout of one side's quantized latents (what `LatentCache` stores and kernels read), per sequence row b
and cache slot s:
- codes  uint8 [max_batch, slots, ceil(rank * bits / 8)]: the slot's `rank` codes as one little-endian
  bit stream: code i occupies bits [i*bits, (i+1)*bits) of the row, least significant bit first (byte
  j holds bits [8j, 8j+8)). 8-bit codes are plain bytes; 4-bit ones two per byte, low nibble first.
- scale, zero  float16 [max_batch, slots, rank / group]: asymmetric min/max quantization over each group
  of `group` consecutive latent channels of one slot (a per-token scale axis): value = code * scale + zero,
  code = round((value - zero) / scale) clamped to [0, 2^bits - 1], zero = the group's minimum.
- exact  16-bit [max_batch, sinks + window, rank] (`exact_dtype`): the latents of the first `sinks` slots,
  then a ring of the most recent `window` slots, slot s at entry sinks + s % window. Every slot also has its
  quantized codes; a reader takes the exact copy where one is held. Empty when the layout keeps none.
16-bit sides are not quantized: latents are stored in the model's dtype; scale, zero and exact are empty.
Beside the sides, the cache holds one int32 [max_batch, slots] buffer of each slot's position, from which
RoPE is computed when keys are rebuilt (no per-slot cos/sin rows are stored).
"""
import torch

QUANTIZED_BITS = (8, 4, 3, 2)


def exact_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype exact (sink and window) latents are held in: the model's when it is 16-bit, else float16."""
    return model_dtype if model_dtype.itemsize == 2 else torch.float16


def packed_width(rank: int, bits: int) -> int:
    """Bytes one slot's codes take."""
    return -(-rank * bits // 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., rank] (integers in [0, 2^bits)) -> uint8 [..., packed_width(rank, bits)]."""
    rank = codes.shape[-1]
    shifts = torch.arange(bits, device=codes.device)
    stream = ((codes.to(torch.int32)[..., None] >> shifts) & 1).flatten(-2)  # [..., rank * bits], LSB first
    padding = packed_width(rank, bits) * 8 - stream.shape[-1]
    stream = torch.nn.functional.pad(stream, (0, padding)).unflatten(-1, (-1, 8))
    return (stream << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, rank: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 [..., width] -> int32 [..., rank]."""
    stream = (packed.to(torch.int32)[..., None] >> torch.arange(8, device=packed.device)) & 1
    stream = stream.flatten(-2)[..., :rank * bits].unflatten(-1, (rank, bits))
    return (stream << torch.arange(bits, device=packed.device)).sum(-1)


def quantize(latent: torch.Tensor, bits: int, group: int):
    """latent [..., rank] -> (codes uint8 [..., width], scale fp16 [..., rank/group], zero fp16 [..., rank/group])."""
    grouped = latent.float().unflatten(-1, (-1, group))                     # [..., groups, group]
    low, high = grouped.amin(-1), grouped.amax(-1)
    levels = 2 ** bits - 1
    scale = ((high - low) / levels).to(torch.float16)
    zero = low.to(torch.float16)
    # quantize against the stored (fp16) scale and zero, so dequantization reproduces the grid exactly
    step = scale.float().clamp_min(2.0 ** -24)[..., None]  # the smallest fp16 step: a constant group gets code 0
    codes = torch.round((grouped - zero.float()[..., None]) / step).clamp_(0, levels)
    return pack_codes(codes.flatten(-2), bits), scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
               dtype=torch.float32) -> torch.Tensor:
    """(codes, scale, zero) from `quantize` -> latent [..., rank] in `dtype`."""
    rank = scale.shape[-1] * group
    values = unpack_codes(codes, bits, rank).float().unflatten(-1, (-1, group))
    return (values * scale.float()[..., None] + zero.float()[..., None]).flatten(-2).to(dtype)


def fake_quantize(latent: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """What a latent reads back as after a trip through the cache: dequantize(quantize(latent))."""
    if bits == 16:
        return latent
    return dequantize(*quantize(latent, bits, group), bits, group, dtype=latent.dtype)
