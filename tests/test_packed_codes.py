"""The GPU's float16 dequantization of packed codes (`latent_tiles.packed_tile`, the PACKED path the launchers take
for float16 models on CUDA) checked on CPU: Triton's interpreter cannot run inline PTX, so a small emulator of the
PTX those strings use (mov, shr, prmt, lop3, fma.rn.f16x2) runs FOUR_BIT_ASM and THREE_BIT_ASM_* on codes written
by `quantize.pack_codes` and read as `packed_tile` reads them (int32 words; at 3 bits, the first, middle and last
words of a unit of `three_bit_order`), and the columns land on the channels `packed_order` names."""
import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from lrkv_compile.kernels import latent_tiles
from lrkv_compile.lowering.quantize import pack_codes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter (conftest.py)


def _half(bits: int) -> np.float64:
    return np.float64(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _bits(value: float) -> int:
    return int(np.array([value], dtype=np.float16).view(np.uint16)[0])


def _fma_f16x2(a: int, b: int, c: int) -> int:
    """fma.rn.f16x2: a * b + c per 16-bit half, rounded once to float16 (products of two float16 values and the
    sums here are exact in float64)."""
    out = 0
    for shift in (0, 16):
        x, y, z = (_half((v >> shift) & 0xFFFF) for v in (a, b, c))
        out |= _bits(x * y + z) << shift
    return out


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 (default mode): byte i of the result is byte selector[i] of the eight bytes b:a."""
    pool = (b << 32 | a).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(selector >> (4 * i)) & 7] for i in range(4)), "little")


def emulate(asm: str, inputs: list[int], outputs: int) -> list[int]:
    """Run an inline-PTX string of latent_tiles on 32-bit and 16-bit operand values; returns the 16-bit outputs."""
    regs = {f"${outputs + i}": value for i, value in enumerate(inputs)}
    result = [0] * outputs

    def value(token: str) -> int:
        return int(token, 16) if token.startswith("0x") else regs[token]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [arg.strip() for arg in re.split(r",(?![^{]*})", rest)]
        if op == "mov.b32" and args[0].startswith("{"):  # unpack into two 16-bit outputs
            low, high = (int(name.strip()[1:]) for name in args[0].strip("{}").split(","))
            result[low], result[high] = value(args[1]) & 0xFFFF, value(args[1]) >> 16
        elif op == "mov.b32" and args[1].startswith("{"):  # pack two 16-bit inputs, the first in the low half
            low, high = (value(name.strip()) for name in args[1].strip("{}").split(","))
            regs[args[0]] = low | high << 16
        elif op == "mov.b32":
            regs[args[0]] = value(args[1])
        elif op == "shr.u32":
            regs[args[0]] = value(args[1]) >> int(args[2])
        elif op == "prmt.b32":
            regs[args[0]] = _prmt(value(args[1]), value(args[2]), int(args[3], 16))
        elif op == "lop3.b32":
            assert args[4] == "0xea", "only (a & b) | c is emulated"
            regs[args[0]] = (value(args[1]) & value(args[2])) | value(args[3])
        elif op == "fma.rn.f16x2":
            regs[args[0]] = _fma_f16x2(value(args[1]), value(args[2]), value(args[3]))
        else:
            raise AssertionError(f"PTX instruction {op!r} is not emulated: extend the emulator")
    return result


def _dequantized(codes, scale, zero):
    """float16(code * scale + zero), rounded once, as the last fma does."""
    return (codes.astype(np.float64) * scale.astype(np.float64) + zero.astype(np.float64)).astype(np.float16)


def _words(packed: torch.Tensor) -> np.ndarray:
    return packed.numpy().view("<u4").astype(np.int64)


@triton.jit
def _order_kernel(out_ptr, CHUNK: tl.constexpr, BITS: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, CHUNK), latent_tiles.packed_order(CHUNK, BITS))


def _order(chunk: int, bits: int) -> np.ndarray:
    """packed_order(chunk, bits), the channel of each column, as the kernels compute it."""
    out = torch.empty(chunk, dtype=torch.int32, device=DEVICE)
    _order_kernel[(1,)](out, CHUNK=chunk, BITS=bits)
    return out.cpu().numpy()


@pytest.mark.parametrize("chunk", [32, 64, 128])
def test_four_bit_words_dequantize_onto_the_channels_packed_order_names(chunk):
    """Column 32 u + 8 i + 2 t + e of packed_tile (output 2 i + e of word t * WORDS + u) holds packed_order's
    channel, dequantized with its group's scale."""
    generator = np.random.default_rng(0)
    codes = generator.integers(0, 16, size=chunk)
    group = 32
    scale = generator.uniform(-0.2, 0.2, chunk // group).astype(np.float16)
    zero = generator.uniform(-1, 1, chunk // group).astype(np.float16)
    words = _words(pack_codes(torch.from_numpy(codes), 4))
    columns = np.empty(chunk, dtype=np.float16)
    words_per_thread = chunk // 32
    for t in range(4):
        for u in range(words_per_thread):
            word = t * words_per_thread + u
            g = word * 8 // group
            out = emulate(latent_tiles.FOUR_BIT_ASM.value, [int(words[word]), _bits(scale[g]), _bits(zero[g])], 8)
            for i in range(4):
                for e in range(2):
                    columns[32 * u + 8 * i + 2 * t + e] = np.uint16(out[2 * i + e]).view(np.float16)
    channel = _order(chunk, 4)
    np.testing.assert_array_equal(columns, _dequantized(codes[channel], scale[channel // group],
                                                        zero[channel // group]))


@pytest.mark.parametrize("rank", [32, 64, 128])
def test_three_bit_words_in_three_bit_order_dequantize_onto_the_channels_packed_order_names(rank):
    """A chunk of 3-bit codes (32 per block of three int32 words, the unit's first words of its blocks, then their
    second, then their third: `three_bit_order`) read as packed_tile reads a whole row's chunk: THREE_BIT_ASM_LO on
    (first, middle) gives codes i and 8 + i of the block, _HI on (middle, last) codes 16 + i and 24 + i."""
    generator = np.random.default_rng(1)
    codes = generator.integers(0, 8, size=rank)
    blocks = rank // 32
    scale = generator.uniform(-0.2, 0.2, blocks).astype(np.float16)
    zero = generator.uniform(-1, 1, blocks).astype(np.float16)
    words = _words(pack_codes(torch.from_numpy(codes), 3))
    columns = np.empty(rank, dtype=np.float16)
    for block in range(blocks):  # one unit of `blocks` blocks (the launcher's chunk is the row's rank here)
        first, middle, last = (int(words[block + k * blocks]) for k in range(3))
        extra = [_bits(scale[block]), _bits(zero[block])]
        low = emulate(latent_tiles.THREE_BIT_ASM_LO.value, [first, middle] + extra, 16)
        high = emulate(latent_tiles.THREE_BIT_ASM_HI.value, [middle, last] + extra, 16)
        halves = np.array(low + high, dtype=np.uint16).view(np.float16)
        columns[32 * block:32 * block + 32] = halves  # output 2 i + e of LO, then of HI: packed_order's columns
    channel = _order(rank, 3)
    np.testing.assert_array_equal(columns, _dequantized(codes[channel], scale[channel // 32], zero[channel // 32]))


def test_the_emulator_fails_a_wrong_mask():
    """The emulator runs what the string says: a mask that drops a code bit gives other values."""
    broken = latent_tiles.FOUR_BIT_ASM.value.replace("0x000f000f", "0x00070007", 1)
    inputs = [0x0000000F, _bits(1.0), _bits(0.0)]
    assert emulate(latent_tiles.FOUR_BIT_ASM.value, inputs, 8)[0] == _bits(15.0)
    assert emulate(broken, inputs, 8)[0] == _bits(7.0)
