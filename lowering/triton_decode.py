"""Triton lowering of `latent_attention` for decode (one new token per sequence): input checks, the diagonal block
structure of the factors, launch geometry, and the value up-projection after the kernel (fused with the reduction of
the splits).

`decode_attention(**kwargs)` takes the keyword arguments of `reference.latent_attention` and returns what it
returns for tokens == 1; anything it does not cover raises NotImplementedError naming what, so the caller can run
the reference instead. The kernels are `kernels/latent_decode.py`, and `kernels/gluon_far.py` for the budget plan's far
slots (`far_loop_able`).
"""
import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import warnings
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from lrkv_compile.errors import SharedLatentsWarning
from lrkv_compile.kernels import latent_decode
from . import ahead, gluon_far, quantize, reference
from .launch import launch as launch_kernel

BITS = (16, 8, 4, 3, 2)
DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch geometry: slots per tile, warps, pipeline stages, and a cap on registers per thread (None: the
    compiler's choice), which trades spills for more programs resident per multiprocessor. The slots are split
    so that the grid fills whole waves of the programs that fit at once (`_splits`). tma: the far tiles of 16-bit
    latents read by the tensor memory accelerator where it can (`tile_descriptor`), else by pointer loads.
    positions_ahead: windowed RoPE's far loop loads each tile's positions (which it checks) a tile ahead, so that the
    check waits on no load. On an H100 (16K, batch 16) it took keep 0.25 w1024 from 0.1143 to 0.1115 ms (Llama-3-8B
    shape) and from 0.4260 to 0.4190 (Llama-2-7B) in 64-slot tiles under the 168-register cap; the budget plan and
    16-bit keep 0.5 lost with it (Llama-2-7B keep 0.5 w1024 0.718 -> 0.729 ms, budget 0.97 -> 1.00).
    across_both: windowed RoPE's tile across the window's edge goes through the far loop (its far slots) and the
    near loop (the others) where it is whole, rather than through the loop of edge tiles, which turns each slot by
    its own angle (latent_decode's ACROSS_BOTH; see WINDOWED_HALVES_MHA for where it is off).
    far_loop: where the cache holds what the Gluon far loop reads (`far_loop_able`), the slots before the window go
    through it and this kernel takes the rest."""
    block_s: int = 32
    num_warps: int = 4
    num_stages: int = 3
    max_registers: Optional[int] = None
    tma: bool = True
    positions_ahead: bool = False
    across_both: bool = True
    far_loop: bool = True


# the fastest of CANDIDATES on an H100 at 16K (benchmarks/attention.py --sweep): 255 registers, two programs per
# multiprocessor, where codes are dequantized or keys kept in float32; 168 (three) for float16 keys of 16-bit latents
DEFAULT = DecodeConfig(block_s=64, num_warps=4, num_stages=3)
DEFAULT_HALVES = DecodeConfig(block_s=64, num_warps=4, num_stages=3, max_registers=168)
# windowed RoPE over 16-bit latents, at most 32 value channels a program (keep 0.25): DEFAULT_HALVES with the far
# tiles' positions a tile ahead; 128-slot tiles without the cap where each KV head serves one query head (MHA). H100,
# keep 0.25 w1024, two runs of benchmarks/attention.py, WINDOWED_HALVES then 128-slot tiles: Llama-2-7B 0.418 -> 0.403
# ms at 16K and batch 16 (3.33x -> 3.43x SDPA), 0.145 -> 0.132 at 4K, 0.373 -> 0.371 at 64K and batch 4; Llama-3-8B
# (4 query heads a KV head) lost with 128-slot tiles (0.110 -> 0.111 at 16K, 0.043 -> 0.045 at 4K, 0.111 -> 0.112 at
# 64K). The MHA geometry keeps the tile across the window's edge in the edge loop: through both loops its far loop
# spilled 2 registers a tile and its near loop 22 (offline sm_90 compile, uncapped at 255), and Llama-2-7B keep 0.25
# w1024 took 0.461-0.462 ms against 0.401 (H100, 16K, batch 16)
WINDOWED_HALVES = DecodeConfig(block_s=64, num_warps=4, num_stages=3, max_registers=168, positions_ahead=True)
WINDOWED_HALVES_MHA = DecodeConfig(block_s=128, num_warps=4, num_stages=3, positions_ahead=True, across_both=False)
CANDIDATES = (DEFAULT, DEFAULT_HALVES, WINDOWED_HALVES, WINDOWED_HALVES_MHA,
              DecodeConfig(block_s=64, num_warps=4, num_stages=3, max_registers=128),
              DecodeConfig(block_s=64, num_warps=4, num_stages=2),
              DecodeConfig(block_s=64, num_warps=4, num_stages=2, max_registers=168),
              DecodeConfig(block_s=128, num_warps=8, num_stages=2),
              DecodeConfig(block_s=128, num_warps=4, num_stages=2),
              DecodeConfig(block_s=32, num_warps=4, num_stages=3, max_registers=128))
FALLBACK = DecodeConfig(block_s=16, num_warps=4, num_stages=1)
# the most warps a program may take over quantized latents: on an H100 (Triton 3.6) 8 warps read the budget plan's
# codes (4-bit keys, 3-bit values) wrong or fault. 64-slot tiles hit an illegal memory access, which poisons the
# CUDA context (exact and windowed RoPE, 2 or 3 stages, with or without a register cap); 128-slot tiles with windowed
# RoPE read wrong without a word (relative error 0.11 at 3 stages, NaN at 2; Llama-3-8B shape, 16K, batch 16), where
# exact RoPE read right. 16-bit latents read right with 8 warps. Refused, not launched
MAX_WARPS_WITH_CODES = 4
WAVE_FILL = 0.9  # the least share of the last wave of programs the split of the slots accepts
MAX_SPLITS = 64  # the most splits of a row's slots per kernel
# the far loop's path (DecodeConfig.far_loop) from caches of this many slots: it has costs of its own (its queries and
# the end of its slots, 7 us then, about 4 us on an H200 now; the window's slots apart, 30 us) that a short cache
# does not repay (budget 0.2 w1024, Llama-3-8B shape, batch 16, H100: 4K 0.0841 -> 0.0927 ms, 16K 0.2416 -> 0.1567).
# The capacity, not the length: the length is on the GPU
FAR_LOOP_FROM = 8192
_BLOCKS = WeakIdKeyDictionary()  # factor tensor -> (its _version, diagonal blocks)


def diagonal_blocks(up: torch.Tensor, num_kv_heads: int) -> int:
    """The most diagonal blocks `up` [rank, kv_heads * head_dim] splits into (rank and heads in equal parts, exact
    zeros off the blocks): kv_heads for head-wise factors, kv_heads / group_size for group-wise ones, 1 for joint.
    Read once per tensor version (it synchronizes)."""
    cached = _BLOCKS.get(up)
    if cached is not None and cached[0] == up._version:
        return cached[1]
    rank = up.shape[0]
    most = math.gcd(rank, num_kv_heads)
    blocks = 1
    if most > 1:
        mass = up.detach().abs().float().reshape(most, rank // most, most, -1).sum((1, 3)).cpu()  # [most, most]
        for count in sorted((c for c in range(2, most + 1) if most % c == 0), reverse=True):
            coarse = mass.reshape(count, most // count, count, most // count).sum((1, 3))
            if coarse.masked_fill(torch.eye(count, dtype=torch.bool), 0).eq(0).all():
                blocks = count
                break
    _BLOCKS[up] = (up._version, blocks)
    return blocks


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_GEOMETRY = {}  # (device, constants, config) -> (launch options, programs resident per multiprocessor)


def _resident(kernel, args, constants, device) -> int:
    """How many programs of this compiled kernel fit on one multiprocessor at once: the least of what its
    registers, shared memory and warps allow."""
    if device.type != "cuda":  # the interpreter: as many as keep its tests splitting the slots
        return 4
    compiled = kernel.warmup(*args, grid=(1,), **constants)
    compiled._init_handles()  # loads the binary: n_regs is known from here
    props = torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256  # registers go to warps 256 at a time
    by_registers = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps)
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // (compiled.metadata.shared + 1024)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(1, min(by_registers, by_shared, by_threads, 32))


def _launch_options(config: DecodeConfig, interpret: bool) -> dict:
    """The decode kernel's launch options and geometry constants for `config` (the register cap only when compiled)."""
    launch = dict(BLOCK_S=config.block_s, num_warps=config.num_warps, num_stages=config.num_stages,
                  POSITIONS_AHEAD=config.positions_ahead, ACROSS_BOTH=config.across_both)
    if config.max_registers is not None and not interpret:
        launch.update(maxnreg=config.max_registers)
    return launch


def _geometry(kernel, arguments, constants, config, device, bf16_codes, interpret):
    """(launch options, resident programs per multiprocessor) of `config` for these constants, or of FALLBACK where
    the compiled kernel does not fit (wide joint chunks); arguments(block_s): a launch's arguments, for the trial
    compile."""
    launch = _launch_options(config, interpret)
    try:
        return launch, _resident(kernel, arguments(config.block_s), {**constants, **launch}, device)
    except OutOfResources:  # a geometry too large for this shape: the smallest one
        if bf16_codes:
            # bfloat16 codes in 16-slot tiles read wrong on an H200 (Triton 3.6), whatever the warps and stages;
            # 32-slot tiles, float16 and 16-bit latents read right (tests/test_kernels.py, the tile-by-tile test)
            raise NotImplementedError("bfloat16 quantized latents at the fallback launch geometry (16-slot tiles): "
                                      "a known wrong result on the GPU, not found yet") from None
        launch = _launch_options(FALLBACK, interpret)
        return launch, _resident(kernel, arguments(FALLBACK.block_s), {**constants, **launch}, device)


def _splits(base: int, slots: int, capacity: int, block_s: int) -> int:
    """Splits of the cache per (batch row, KV head, value chunk): the fewest that make the grid fill whole waves
    of resident programs (`slots` programs at a time) to WAVE_FILL, as long programs amortize their setup;
    at most MAX_SPLITS and at least two tiles each."""
    most = max(1, min(capacity // (2 * block_s), MAX_SPLITS))
    for splits in range(1, most + 1):
        waves = base * splits / slots
        if waves >= WAVE_FILL and waves / math.ceil(waves) >= WAVE_FILL:
            return splits
    return most


def far_and_near_splits(far: int, wave: int, near: int, block_s: int) -> tuple:
    """(far loop's splits, decode kernel's splits) where the far loop takes the far slots in `far` splits (one wave
    of its programs) and the decode kernel the `near` slots after them plus a tile: the kernel's splits as many as one
    wave of its programs holds (`wave`; each further wave added 6-8 us: budget 0.2 w1024, Llama-3-8B shape, 16K,
    batch 16, H100) with two tiles each or more, and both together at most MAX_SPLITS, as the combine loads them all at
    once, padded to a power of two: over 64 it took three times as long (Llama-3-8B shape, 64K, batch 4, H100: 64 far
    splits and 8 near, 170.4 us a step, the combine 35.9 of it; 56 and 8, 151.5 and 11.8)."""
    splits = min(MAX_SPLITS - 1, max(1, min(wave, (triton.cdiv(near, block_s) + 1) // 2)))
    return max(1, min(far, MAX_SPLITS - splits)), splits


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def _beside(device: torch.device, fork: torch.cuda.Event):
    """Launches inside run on a second stream of `device` once the current stream has reached `fork`, and the
    current stream waits for them on leaving (a fork and a join, which CUDA graphs capture)."""
    main, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_event(fork)
    with torch.cuda.stream(side):
        yield
    main.wait_stream(side)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def combine_geometry(splits: int, group: int, v_range: int, head_dim: int, elements: int = 4096, d_block: int = 32,
                     num_warps: int = 1) -> dict:
    """combine_project_kernel's tiles and warps: every split's partials of CHUNK channels at once and their product
    with D_BLOCK output channels of B_v, each tile at most `elements` float32. One warp: its sums over the splits and
    channels stay within the warp (no shared memory, no barrier). Timed on an H100 (whole decode steps, Llama-3-8B
    shape, 16K, batch 16, over 4096 x 32 x 1 warp against tiles of 1024-8192, blocks of 16-128 channels, 1-8 warps):
    budget 0.2 w1024 137.6 us against 140-224, keep 0.25 w1024 105.2 against 105.1-126; the loop over the splits
    before it took 152 and 106."""
    g_pow2, splits_pad, d_block = _pow2(group), _pow2(splits), min(head_dim, d_block)
    chunk = max(1, min(_pow2(v_range), elements // (splits_pad * g_pow2), elements // (g_pow2 * d_block)))
    return dict(G_POW2=g_pow2, SPLITS_PAD=splits_pad, CHUNK=chunk, D_BLOCK=d_block, num_warps=num_warps)


def channel_chunk(block_rank: int) -> int:
    """Latent channels of one side a program reads per tile: the block's rank up to a power of two, 16 to 128
    (codes may widen it to their group)."""
    return max(16, min(_pow2(block_rank), 128))


def _side(name, latent, scale, zero, exact, new, bits, group, sinks, axis, outliers, blocks, halves):
    """Kernel arguments and constants of one side (K or V); halves: the latents are float16 and the codes may be
    dequantized in float16 registers (PACKED)."""
    if bits not in BITS:
        raise NotImplementedError(f"{name}_bits={bits}: the Triton decode kernel reads bits {BITS}")
    if axis not in ("token", "channel"):
        raise NotImplementedError(f"{name}_axis={axis!r}: the Triton decode kernel reads 'token' and 'channel' scales")
    rank = new.shape[-1]
    block_rank = rank // blocks
    chunk = channel_chunk(block_rank)
    dummy = latent
    # stored: the blocks the cache stores apart (`quantize.by_blocks`: head-major), the factor's, or 1 for rows; a
    # kernel reads block ch // STORED of them (STORED: a block's channels, 0 for rows, a compile-time choice), `sk`
    # (codes) and `sz_sk` (scales and zero points) apart, through pointers moved back by the blocks before it
    # (latent_tiles.stored_block)
    stored = latent.shape[2] if latent.dim() == 4 else 1
    new = new.reshape(new.shape[0], rank)  # the kernel takes its row stride: a view of both sides' latents stays one
    new = new if new.stride(1) == 1 else new.contiguous()
    side = dict(latent=latent, scale=dummy, zero=dummy, exact=dummy, new=new,
                width=rank, sinks=0, window=0, sk=0, sz_sk=0, STORED=0, BITS=bits, GROUP=1, FAST=False,
                EXACT=False, CHANNEL=False, OUTLIERS=0, PACKED=False, PACKS=False, BLOCK_RANK=block_rank, CHUNK=chunk)
    if latent.stride(-1) != 1:
        raise NotImplementedError(f"latent_{name} has a non-contiguous last axis")
    if bits == 16:
        if not latent.is_floating_point() or latent.dim() != 3:
            raise NotImplementedError(f"{name}_bits=16 needs floating-point latents [batch, slots, rank], got "
                                      f"{latent.dtype} {tuple(latent.shape)}")
        return side
    if latent.dtype != torch.uint8 or scale.stride(-1) != 1 or zero.stride(-1) != 1:
        raise NotImplementedError(f"{name}: packed codes must be uint8 with contiguous scales and zero points")
    # values read whole (the output projection absorbed B_v: every KV head takes every channel) from a cache stored
    # by their factor's blocks: read block by block, each chunk of channels inside one stored block
    whole = stored > 1 and blocks == 1 and not rank % stored
    if stored > 1 and (stored != quantize.stored_blocks(bits, group, axis, outliers, rank, stored if whole else blocks)
                       or scale.dim() != 4 or zero.dim() != 4 or scale.shape[2] != stored
                       or zero.stride() != scale.stride()):
        raise NotImplementedError(f"{name}: codes stored in {stored} blocks for a factor of {blocks}, with scales "
                                  f"{tuple(scale.shape)} and zero points {tuple(zero.shape)}: expected the factor's "
                                  "blocks, each with its scales (zero points laid out as the scales) and whole bytes "
                                  "of codes (`quantize.stored_blocks`)")
    if whole:
        per_block = rank // stored
        if per_block % 16:
            raise NotImplementedError(f"{name}: {rank} channels read whole from {stored} stored blocks of {per_block}: "
                                      "the kernel's chunks of channels (16 or more) would cross the blocks")
        chunk = max(size for size in (16, 32, 64, 128) if not per_block % size)
    if stored > 1:
        side.update(sk=latent.stride(2), sz_sk=scale.stride(2), STORED=rank // stored)
    channel = axis == "channel"  # a scale per channel and block of `group` slots (KIVI's keys)
    if not 0 <= outliers < rank:
        raise NotImplementedError(f"{name}_outliers={outliers} for rank {rank}")
    if group < 1 or ((rank - outliers) % group and not channel):
        raise NotImplementedError(f"{name}_group={group} does not divide the {rank - outliers} quantized channels")
    if group & (group - 1) == 0 and group <= 128 and not channel:
        chunk = max(chunk, group)
    # whole groups of whole bytes (3-byte words of 8 codes at 3 bits) per block: contiguous loads (grouped_tile)
    fast = (not channel and not outliers and group & (group - 1) == 0 and group <= chunk and block_rank % group == 0
            and (group * bits) % (24 if bits == 3 else 8) == 0)
    # whole int32 words per group (8 codes at 4 bits, 32 in three words at 3) on 4-byte aligned rows (and stored
    # blocks: their pointer moves back by whole blocks, latent_tiles.stored_block); at 3 bits
    # each chunk starts a multiple of its size in (and the rank is a multiple of it), so its blocks lie in one unit
    # of `quantize.three_bit_order` (packed_tile)
    packs = (fast and bits in (3, 4) and group % (8 if bits == 4 else 32) == 0 and chunk % 32 == 0
             and (bits == 4 or block_rank % chunk == 0)
             and all(stride % 4 == 0 for stride in latent.stride()[:-1]) and latent.data_ptr() % 4 == 0
             and (stored == 1 or latent.shape[-1] % 4 == 0))
    side.update(scale=scale, zero=zero, width=latent.shape[-1], GROUP=group, FAST=fast, CHANNEL=channel,
                OUTLIERS=outliers, PACKED=halves and packs, PACKS=packs, CHUNK=chunk)
    if exact.numel():
        if exact.stride(-1) != 1:
            raise NotImplementedError(f"{name}_exact has a non-contiguous last axis")
        side.update(exact=exact, sinks=sinks, window=exact.shape[1] - sinks, EXACT=True)
    return side


def side_arguments(side: dict) -> tuple:
    """A side's cache tensors and strides as the kernels take them (`latent_tiles.latent_tile`'s side before its
    widths): latents with their batch, slot and block strides, scales and zero points with theirs, exact copies."""
    latent, scale, exact = side["latent"], side["scale"], side["exact"]
    return (latent, latent.stride(0), latent.stride(1), side["sk"], scale, side["zero"], scale.stride(0),
            scale.stride(1), side["sz_sk"], exact, exact.stride(0), exact.stride(1))


def side_widths(side: dict) -> tuple:
    """The rest of a side as the kernels take it: a stored block's width, sinks, window."""
    return side["width"], side["sinks"], side["window"]


def _tma_able(side: dict, interpret: bool) -> bool:
    """Whether the tensor memory accelerator can read this side's tiles: unquantized (16-bit) latents in the model's
    dtype, [batch, slots, width], on Hopper or later (or the interpreter), whose chunks never overrun the block's
    channels (its loads are unmasked), address and strides multiples of 16 bytes."""
    latent = side["latent"]
    if side["BITS"] != 16 or side["BLOCK_RANK"] % side["CHUNK"] or latent.dim() != 3:
        return False
    if not interpret and torch.cuda.get_device_capability(latent.device)[0] < 9:
        return False
    size = latent.element_size()
    return latent.data_ptr() % 16 == 0 and all(stride * size % 16 == 0 for stride in latent.stride()[:2])


def tile_descriptor(side: dict, block_s: int) -> TensorDescriptor:
    """A side's 16-bit latents as a tensor descriptor whose blocks are the decode kernel's tiles [1, block_s, CHUNK],
    for a side `_tma_able` accepts (for the others the kernel loads through pointers). The kernel reads its far
    tiles (windowed RoPE) through it: on an H100 (16K, batch 16) keep 0.25 w1024 took 0.1128 ms against 0.1159
    through pointers (Llama-3-8B shape) and 0.4272 against 0.4482 (Llama-2-7B); the tiles whose keys are rebuilt
    were 1-4% slower through it (keep 0.25 exact 0.1344 against 0.1301 ms), so they keep pointer loads."""
    latent = side["latent"]
    return TensorDescriptor(latent, list(latent.shape), list(latent.stride()), [1, block_s, side["CHUNK"]])


def values_first(values: dict, interpret: bool) -> bool:
    """Whether the kernel takes the value product transposed, C_vᵀ p (latent_decode's VALUES_FIRST), for this value
    side (`_side`): for packed codes on the GPU (3 and 4 bits in float16 models); under the interpreter, which never
    packs, for the layouts a float16 GPU would pack, so the CPU tests meet both value products over codes. Other
    codes through C_vᵀ p read NaN or faulted on an H100 (8-bit values in 64-slot tiles, Triton 3.6)."""
    return values["PACKED"] or (interpret and values["PACKS"])


def check_inputs(query, num_kv_heads, inv_freq, kernel: str) -> bool:
    """What the decode and prefill launchers both check of a step: NotImplementedError naming what the Triton
    `kernel` ("decode" or "prefill") does not cover. Returns whether Triton's interpreter runs it."""
    heads, head_dim = query.shape[1], query.shape[-1]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if query.device.type != "cuda" and not interpret:
        raise NotImplementedError(f"{query.device.type} tensors: the Triton {kernel} kernel runs on CUDA (or with "
                                  "TRITON_INTERPRET=1)")
    if query.dtype not in DTYPES:
        raise NotImplementedError(f"query dtype {query.dtype}: the Triton {kernel} kernel takes {list(DTYPES)}")
    if head_dim & (head_dim - 1) or not 32 <= head_dim <= 256:
        raise NotImplementedError(f"head_dim={head_dim}: the Triton {kernel} kernel takes powers of two from 32 to "
                                  "256")
    if heads % num_kv_heads or heads // num_kv_heads > 64:
        raise NotImplementedError(f"{heads} query heads over {num_kv_heads} KV heads")
    if inv_freq is not None and inv_freq.numel() != head_dim // 2:
        raise NotImplementedError(f"inv_freq of {inv_freq.numel()} frequencies for head_dim {head_dim} (partial RoPE)")
    return interpret


def default_config(half_keys: bool, codes: bool, value_chunk: int, windowed: bool, query_group: int) -> DecodeConfig:
    """The launch geometry `decode_attention` takes (query_group: query heads per KV head): DEFAULT_HALVES where keys
    are rebuilt in float16 (float16 models, head- or group-wise factors) from 16-bit latents and a program holds at
    most 64 value channels (for windowed RoPE see below), DEFAULT where codes are dequantized, keys are float32 or the
    value chunk is wider (their registers would spill under the cap: 16-bit keep 0.5 keys with full-rank values took
    0.47 ms capped against 0.25-0.27 ms uncapped, Llama-3-8B shape at 16K, batch 16, on an H200). The windowed kernel,
    with its loop over far tiles, spills 46 registers under the cap at 64 value channels against 14 without windowed
    RoPE: on an H100 (16K, batch 16, keep 0.5) it took 0.213 ms capped and 0.195 uncapped, while the exact kernel took
    0.204 capped and 0.211 uncapped, and keep 0.25 windowed 0.117 capped and 0.127 uncapped. So windowed plans take
    the cap only at 32 value channels or fewer, as WINDOWED_HALVES (the far tiles' positions loaded a tile ahead), or
    take WINDOWED_HALVES_MHA (128-slot tiles, uncapped) where each KV head serves one query head."""
    if not half_keys or codes or value_chunk > (32 if windowed else 64):
        return DEFAULT
    if windowed:
        return WINDOWED_HALVES_MHA if query_group == 1 else WINDOWED_HALVES
    return DEFAULT_HALVES


def decode_attention(*, query, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, positions,
                     new_k, new_v, up_k, bias_k, up_v, bias_v, inv_freq, rope_scale, length, attn_mask, softmax_scale,
                     num_kv_heads, k_bits, k_group, k_sinks, k_axis, k_outliers, v_bits, v_group, v_sinks, v_axis,
                     v_outliers, rope_window=0):
    """`reference.latent_attention` for one new token per sequence, on the Triton kernel (default geometry)."""
    return decode_attention_with(None, **{name: value for name, value in locals().items()})


def _layout(*, query, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, new_k, new_v, up_k,
            up_v, inv_freq, attn_mask, num_kv_heads, k_bits, k_group, k_sinks, k_axis, k_outliers, v_bits, v_group,
            v_sinks, v_axis, v_outliers, rope_window, **_):
    """The checks of a decode step's arguments (those of `decode_attention`; the ones this does not read are
    ignored) and what the launch follows from them: (interpret, query heads per KV head, diagonal blocks of B_k and
    B_v, each side's kernel arguments and constants (`_side`), float16 keys, codes, windowed RoPE)."""
    batch, heads, tokens, _ = query.shape
    if tokens != 1:
        raise NotImplementedError(f"tokens={tokens}: the Triton kernel covers decode (one new token) only")
    interpret = check_inputs(query, num_kv_heads, inv_freq, "decode")
    if attn_mask is not None and (attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1
                                  or attn_mask.shape[0] not in (1, batch)):
        raise NotImplementedError(f"attn_mask of shape {tuple(attn_mask.shape)}: expected [batch|1, 1, 1, slots]")
    k_blocks = diagonal_blocks(up_k, num_kv_heads)
    v_blocks = diagonal_blocks(up_v, num_kv_heads) if up_v is not None else 1
    halves = query.dtype == torch.float16 and not interpret
    keys = _side("k", latent_k, k_scale, k_zero, k_exact, new_k, k_bits, k_group, k_sinks, k_axis, k_outliers,
                 k_blocks, halves)
    values = _side("v", latent_v, v_scale, v_zero, v_exact, new_v, v_bits, v_group, v_sinks, v_axis, v_outliers,
                   v_blocks, halves)
    # keys accumulate and turn in float16 where the factor's block is one chunk (a few roundings, like the cast after)
    half_keys = halves and keys["BLOCK_RANK"] <= keys["CHUNK"]
    return (interpret, heads // num_kv_heads, k_blocks, v_blocks, keys, values, half_keys,
            k_bits != 16 or v_bits != 16, bool(rope_window) and inv_freq is not None)


_WARNED_SHARED = set()  # (side, blocks, KV heads) said once in this process


def _warn_shared(side: str, blocks: int, num_kv_heads: int) -> None:
    """A SharedLatentsWarning, once per process and kind, for a side whose latents several KV heads share (the
    absorbed value path reads all of its value latents per KV head whatever the scheme: not counted)."""
    if (side, blocks, num_kv_heads) in _WARNED_SHARED:
        return
    _WARNED_SHARED.add((side, blocks, num_kv_heads))
    work = "rebuilds its keys from" if side == "key" else "reads"
    warnings.warn(
        f"lrkv: the GPU decode kernel reads {side} latents that {num_kv_heads // blocks} KV heads share ({blocks} "
        f"block(s) for {num_kv_heads} KV heads: a joint- or group-scheme side): each KV head {work} every channel "
        f"of its block, {num_kv_heads // blocks}x the work of head-wise latents (H100, Llama-3-8B shape, 16K "
        "tokens, batch 16: joint keep 0.5 and 0.25 ran at 0.06x and 0.17x the speed of SDPA over the full cache, "
        "head-wise at 1.73x and 2.66x; benchmarks/attention.py). For GPU decoding calibrate with scheme='head' "
        "(`lrkv calibrate --scheme head`)", SharedLatentsWarning, stacklevel=3)


def launch_config(*, query, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, positions, new_k,
                  new_v, up_k, bias_k, up_v, bias_v, inv_freq, rope_scale, length, attn_mask, softmax_scale,
                  num_kv_heads, k_bits, k_group, k_sinks, k_axis, k_outliers, v_bits, v_group, v_sinks, v_axis,
                  v_outliers, rope_window=0) -> DecodeConfig:
    """The launch geometry `decode_attention` takes for these arguments (`default_config` of what they imply), for
    benchmarks to report."""
    _, group, _, _, _, values, half_keys, codes, windowed = _layout(**locals())
    return default_config(half_keys, codes, values["CHUNK"], windowed, group)


@functools.lru_cache(maxsize=None)
def _gluon() -> bool:
    """Whether this Triton has the Gluon dialect the far loop is written in."""
    return importlib.util.find_spec("triton.experimental.gluon") is not None


@functools.lru_cache(maxsize=None)
def _mma_sync(device: torch.device) -> bool:
    """Whether `device` runs the far loop's tensor-core products (mma.sync m16n8k16: an NVIDIA GPU from sm_80)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 0)


def far_loop_able(*, config, interpret, windowed, query, attn_mask, bias_k, num_kv_heads, group, k_blocks, v_blocks,
                  keys, values, k_bits, v_bits, k_group, v_group, k_axis, v_axis, k_outliers, v_outliers, k_sinks,
                  v_sinks, up_v, **_) -> bool:
    """Whether the Gluon far loop (`lowering/gluon_far.py`) can take this step's far slots: windowed RoPE over the
    budget plan's latents (per KV head 4-bit keys of rank 64 and 3-bit values of rank 128, groups of 32 per token, no
    outliers, the same sinks on both sides, 16 at most: its first 16-slot group), float16, head-wise factors, no mask
    or the boolean mask [rows or 1, 1, 1, slots] transformers builds for SDPA, no key bias, 64-slot tiles (the far
    loop's), at most 64 KV heads, on an NVIDIA GPU from sm_80; codes as rows or stored by KV head."""
    return (not interpret and windowed and _gluon() and _mma_sync(query.device) and query.dtype == torch.float16
            and gluon_far.reads_mask(attn_mask, query.shape[0])
            and config.block_s == gluon_far.BLOCK and num_kv_heads <= 64
            and bias_k is None and up_v is not None and group <= 8 and k_blocks == num_kv_heads
            and v_blocks == num_kv_heads and keys["BLOCK_RANK"] == gluon_far.RANK_K
            and values["BLOCK_RANK"] == gluon_far.RANK_V and (k_bits, v_bits) == (4, 3)
            and k_group == v_group == gluon_far.GROUP and k_axis == v_axis == "token"
            and k_outliers == v_outliers == 0 and k_sinks == v_sinks and k_sinks <= 16
            and (not k_sinks or (keys["EXACT"] and values["EXACT"]))
            and all(side["latent"].dim() == 3 or side["latent"].shape[2] == num_kv_heads for side in (keys, values)))


def decode_attention_with(config: Optional[DecodeConfig], *, query, latent_k, k_scale, k_zero, k_exact, latent_v,
                          v_scale, v_zero, v_exact, positions, new_k, new_v, up_k, bias_k, up_v, bias_v, inv_freq,
                          rope_scale, length, attn_mask, softmax_scale, num_kv_heads, k_bits, k_group, k_sinks,
                          k_axis, k_outliers, v_bits, v_group, v_sinks, v_axis, v_outliers, rope_window=0):
    """`decode_attention` with an explicit launch geometry (None: `default_config`; benchmarks sweep it)."""
    interpret, group, k_blocks, v_blocks, keys, values, half_keys, codes, windowed = _layout(**locals())
    for side, blocks in (("key", k_blocks), ("value", v_blocks if up_v is not None else num_kv_heads)):
        if blocks < num_kv_heads:
            _warn_shared(side, blocks, num_kv_heads)
    batch, heads, _, head_dim = query.shape
    device = query.device
    v_range = values["BLOCK_RANK"]
    v_parts = triton.cdiv(v_range, values["CHUNK"])
    g_pad = max(16, _pow2(group))  # the scores' tensor-core columns: the query heads sharing the rebuilt keys

    if not isinstance(length, torch.Tensor):
        length = torch.tensor(int(length), device=device)
    length = length.to(device)
    capacity = latent_k.shape[1]
    base = batch * num_kv_heads * v_parts

    query = query.contiguous()
    up = up_k.to(query.dtype).contiguous()
    mask_kind, mask, mask_sb, mask_ss = 0, query, 0, 0
    if attn_mask is not None:
        mask_kind, mask = (1 if attn_mask.dtype == torch.bool else 2), attn_mask
        mask_sb = attn_mask.stride(0) if attn_mask.shape[0] == batch else 0
        mask_ss = attn_mask.stride(3)
    rope = inv_freq is not None
    qk_scale = softmax_scale * (rope_scale if rope else 1.0) * math.log2(math.e)  # the kernel's softmax is base 2
    k, v = keys, values
    kernel = latent_decode.latent_decode_kernel
    if config is None:
        config = default_config(half_keys, codes, values["CHUNK"], windowed, group)
    # the far slots through the Gluon far loop, in its splits (one wave of its programs, gluon_far.wave; with this
    # kernel beside it on a second stream, gluon_far.beside's programs a multiprocessor), before this kernel's;
    # start: far_prep_kernel's firsts, from which this kernel's slots begin in each batch row
    far_splits, start, fork = 0, None, None
    if config.far_loop and capacity >= FAR_LOOP_FROM and far_loop_able(**locals()):
        far_splits = min(MAX_SPLITS, max(1, round(gluon_far.wave(device) * _multiprocessors(device)
                                                  / (batch * num_kv_heads))))
        start = torch.empty(batch * num_kv_heads, dtype=torch.int32, device=device)
    far, far_bias = query, query
    if windowed and keys["BLOCK_RANK"] > keys["CHUNK"]:  # joint keys: the kernel reads the far queries chunk by chunk
        far, far_bias = far_queries(query, positions, length, inv_freq, up_k, bias_k, num_kv_heads, k_blocks,
                                    rope_window, g_pad)
        far_bias = query if far_bias is None else far_bias

    def arguments(splits, part_acc, part_max, part_sum, block_s, start=None):
        return (
            query, query.stride(0), query.stride(1),
            *side_arguments(k), k["new"], k["new"].stride(0),
            *side_arguments(v), v["new"], v["new"].stride(0),
            positions, positions.stride(0), up, up.stride(0),
            bias_k.float().contiguous() if bias_k is not None else query,
            inv_freq.float().contiguous() if rope else query, mask, mask_sb, mask_ss, length, far, far_bias,
            part_acc, part_max, part_sum,
            qk_scale, splits, *side_widths(k), *side_widths(v),
            int(rope_window) if windowed else 0,
            tile_descriptor(k, block_s) if tma[0] else None, tile_descriptor(v, block_s) if tma[1] else None,
            start, far_splits)

    constants = dict(
        KV_HEADS=num_kv_heads, GROUP_HEADS=group, G_PAD=g_pad, HEAD_DIM=head_dim,
        K_HEADS_PER_BLOCK=num_kv_heads // k_blocks, K_BLOCK_RANK=k["BLOCK_RANK"], K_CHUNK=k["CHUNK"],
        K_BITS=k["BITS"], K_GROUP=k["GROUP"], K_FAST=k["FAST"], K_EXACT=k["EXACT"], K_CHANNEL=k["CHANNEL"],
        K_OUTLIERS=k["OUTLIERS"], K_PACKED=k["PACKED"], K_STORED=k["STORED"],
        V_HEADS_PER_BLOCK=num_kv_heads // v_blocks, V_BLOCK_RANK=v_range, V_CHUNK=v["CHUNK"],
        V_BITS=v["BITS"], V_GROUP=v["GROUP"], V_FAST=v["FAST"], V_EXACT=v["EXACT"], V_CHANNEL=v["CHANNEL"],
        V_OUTLIERS=v["OUTLIERS"], V_PACKED=v["PACKED"], V_STORED=v["STORED"],
        HAS_ROPE=rope, HAS_BIAS=bias_k is not None, MASK_KIND=mask_kind,
        EXACT_ANGLES=query.dtype == torch.float32, FAST_MATH=not interpret, DTYPE=DTYPES[query.dtype],
        DOT_DTYPE=tl.float32 if interpret else DTYPES[query.dtype],  # the interpreter's dot misreads bf16
        KEY_DTYPE=tl.float16 if half_keys else tl.float32, IEEE=query.dtype == torch.float32, WINDOWED=windowed,
        VALUES_FIRST=values_first(v, interpret), FAR=far_splits > 0)
    if codes and config.num_warps > MAX_WARPS_WITH_CODES:
        raise NotImplementedError(f"num_warps={config.num_warps} over quantized latents: wrong results or an illegal "
                                  f"memory access on an H100 (Triton 3.6); take {MAX_WARPS_WITH_CODES} warps or fewer")
    far_tma = config.tma and windowed  # only far tiles read through descriptors (tile_descriptor)
    # whether each side goes through the tensor memory accelerator changes the compiled kernel
    tma = tuple(far_tma and _tma_able(side, interpret) for side in (k, v))
    geometry_key = (device, tuple(constants.values()), config, tma)
    if geometry_key not in _GEOMETRY:
        scratch = torch.empty(1, dtype=torch.float32, device=device)
        bf16_codes = query.dtype == torch.bfloat16 and codes and not interpret
        _GEOMETRY[geometry_key] = _geometry(kernel, functools.partial(arguments, 2, scratch, scratch, scratch,
                                                                      start=start),
                                            constants, config, device, bf16_codes, interpret)
    launch, resident = _GEOMETRY[geometry_key]
    # with a mask too (every decode step of a model passes one): a far split whose slots the mask keeps all reads it
    # once, not per tile (`kernels.gluon_far._all_kept`; H100, budget 0.2 w1024, Llama-3-8B shape, 16K, batch 16, an
    # all-true mask: 0.1267 ms one after the other, 0.1119 beside; docs/gpu-notes.md, "Stop 71")
    beside = gluon_far.beside(device) if far_splits else 0
    if far_splits:
        near = max(k["window"], v["window"], int(rope_window))  # the slots this kernel takes, but for the last tile
        wave = resident * _multiprocessors(device) // base
        if beside:  # the far loop at `beside` programs a multiprocessor, and this kernel at one beside them (two:
            # 0.1140 / 0.1063 ms against 0.1077 / 0.1035 at one; H100, docs/gpu-notes.md, "Stop 70")
            far_splits, wave = beside * _multiprocessors(device) // base, _multiprocessors(device) // base
        far_splits, splits = far_and_near_splits(far_splits, wave, near, launch["BLOCK_S"])
    else:
        splits = _splits(base, resident * _multiprocessors(device), capacity, launch["BLOCK_S"])
    rows = batch * num_kv_heads * (far_splits + splits) * group
    part_acc = torch.empty(rows * v_range, dtype=torch.float32, device=device)
    part_max = torch.empty(rows, dtype=torch.float32, device=device)
    part_sum = torch.empty(rows, dtype=torch.float32, device=device)
    if far_splits:
        queries = torch.empty(batch * num_kv_heads, 8, gluon_far.RANK_K, dtype=torch.float16, device=device)
        launch_kernel(latent_decode.far_prep_kernel, (batch * num_kv_heads, 2),
                      (query, query.stride(0), query.stride(1), far_rows(up_k, num_kv_heads, k_blocks),
                       inv_freq.float().contiguous(), positions, positions.stride(0), length, queries, start,
                       max(k["window"], v["window"]), int(rope_window), qk_scale),
                      dict(KV_HEADS=num_kv_heads, GROUP_HEADS=group, HEAD_DIM=head_dim, RANK=gluon_far.RANK_K,
                           TILE=gluon_far.BLOCK, BLOCK=2048))
        # (a thread that compiles ahead launches nothing: no stream to fork)
        fork = torch.cuda.current_stream(device).record_event() if beside and not ahead.compiling() else None
        gluon_far.far_splits(
            latent_k=latent_k, k_scale=k_scale, k_zero=k_zero, k_exact=k_exact, latent_v=latent_v, v_scale=v_scale,
            v_zero=v_zero, v_exact=v_exact, queries=queries,
            far_hi=start, sinks=k["sinks"], splits=far_splits, row_splits=far_splits + splits, part_max=part_max,
            part_sum=part_sum, part_acc=part_acc, kv_heads=num_kv_heads, group=group, attn_mask=attn_mask)
    # beside the far loop (`gluon_far.beside`): the window's slots on a second stream from where far_prep_kernel has
    # written `start`, joined before the combine
    window = arguments(splits, part_acc, part_max, part_sum, launch["BLOCK_S"], start)
    with _beside(device, fork) if fork is not None else contextlib.nullcontext():
        launch_kernel(kernel, (batch * num_kv_heads, splits, v_parts), window, {**constants, **launch})
    splits += far_splits
    if up_v is None:  # the output projection absorbed B_v: the latent context itself
        context = torch.empty(batch * heads, v_range, dtype=torch.float32, device=device)
        chunk = min(_pow2(v_range), 256)
        launch_kernel(latent_decode.combine_splits_kernel, (batch * heads, triton.cdiv(v_range, chunk)),
                      (part_acc, part_max, part_sum, context, splits),
                      dict(GROUP_HEADS=group, RANGE=v_range, SPLITS_PAD=_pow2(splits), CHUNK=chunk))
        return context.reshape(batch, 1, heads * v_range).to(query.dtype)
    # the splits' contexts combined and taken through B_v in one launch (a combine, a float32 product and a cast
    # before: 8-15 us a layer in the attention benchmark's profile)
    out = torch.empty(batch, heads, 1, head_dim, dtype=query.dtype, device=device)
    combine = combine_geometry(splits, group, v_range, head_dim)
    launch_kernel(latent_decode.combine_project_kernel, (batch * num_kv_heads, head_dim // combine["D_BLOCK"]),
                  (part_acc, part_max, part_sum, _per_head(up_v, num_kv_heads, v_blocks),
                   bias_v.contiguous() if bias_v is not None else part_acc, out, splits),
                  dict(KV_HEADS=num_kv_heads, GROUP_HEADS=group, RANGE=v_range, HEAD_DIM=head_dim,
                       HAS_BIAS=bias_v is not None, **combine))
    return out


def far_queries(query, positions, length, inv_freq, up_k, bias_k, kv_heads, blocks, window, columns):
    """The queries as windowed RoPE scores slots beyond the window, in latent space, for joint keys (the kernel makes
    them itself where a KV head's block of B_k is one chunk): per KV head h and its query heads g, R(window - p) q_g
    (p this step's position) through the head's rows of B_k, float32 [batch, kv_heads, rank, columns] (query heads in
    the first columns, zeros after), and their products with the key bias [batch, kv_heads, columns] (None without
    one): q R(p - window) (c B_k + b_k)ᵀ = c (B_k R(window - p) q)ᵀ + b_k·R(...)q."""
    batch, heads, _, head_dim = query.shape
    group = heads // kv_heads
    at = positions[:batch].index_select(1, (length.reshape(1) - 1).long())  # [batch, 1]
    cos, sin = reference.rope_tables(window - at, inv_freq, 1.0, torch.float32)  # RoPE's scale is in qk_scale
    turned = reference.turn(query[:, :, 0].float(), cos, sin).view(batch, kv_heads, group, head_dim)
    rows = _per_head(up_k, kv_heads, blocks)                                 # [kv_heads, rank, head_dim]
    far = torch.zeros(batch, kv_heads, rows.shape[1], columns, dtype=torch.float32, device=query.device)
    far[..., :group] = torch.einsum("bkgd,krd->bkrg", turned, rows)
    if bias_k is None:
        return far, None
    bias = torch.zeros(batch, kv_heads, columns, dtype=torch.float32, device=query.device)
    bias[..., :group] = (turned * bias_k.float().view(1, kv_heads, 1, head_dim)).sum(-1)
    return far, bias


def project_values(context, up_v, bias_v, blocks, tokens, dtype):
    """The latent context [batch, kv_heads, group * tokens, range] (each KV head's query heads, then tokens) @ B_v
    (+ b_v) per KV head, in the context's dtype (float32 accumulation): [batch, heads, tokens, head_dim] in `dtype`.
    The decode kernel and the prefill kernel hand over float32 (the reference's precision), the prefill rebuild path
    its attention's model dtype (no float32 copy of a long prompt's context)."""
    batch, kv_heads, rows, _ = context.shape
    out = context @ _per_head(up_v, kv_heads, blocks).to(context.dtype)  # [batch, kv_heads, rows, head_dim]
    if bias_v is not None:
        out = out + bias_v.to(context.dtype).view(1, kv_heads, 1, -1)
    return out.view(batch, kv_heads * rows // tokens, tokens, -1).to(dtype)


def prepare(up_k: torch.Tensor, up_v: Optional[torch.Tensor], num_kv_heads: int, rope_window: int = 0) -> None:
    """Build now what the launcher keeps per factor tensor (its diagonal blocks, B_v's rows per head, and B_k's
    where windowed RoPE reads them, on a GPU also in the far loop's rank order: `far_rows`): called when a graph is
    compiled, so these tensors are not allocated inside a CUDA graph's memory pool (mode "reduce-overhead"), where a
    tensor that outlives the step is an error, and reading the blocks (which synchronizes) never happens in a step."""
    k_blocks = diagonal_blocks(up_k, num_kv_heads)
    if rope_window:
        rows = _per_head(up_k, num_kv_heads, k_blocks)
        if up_k.is_cuda and rows.shape[1] == gluon_far.RANK_K:
            far_rows(up_k, num_kv_heads, k_blocks)
    if up_v is not None:
        _per_head(up_v, num_kv_heads, diagonal_blocks(up_v, num_kv_heads))


def far_rows(up_k, kv_heads, blocks):
    """`_per_head`'s rows of B_k with each KV head's ranks in the Gluon far loop's order (`gluon_far.key_order`), as
    `latent_decode.far_prep_kernel` reads them: built once per tensor version, like the rows."""
    rows = _per_head(up_k, kv_heads, blocks)
    cached = _FAR_ROWS.get(up_k)
    if cached is not None and cached[0] is rows:
        return cached[1]
    ordered = rows[:, gluon_far.key_order(rows.device)].contiguous()
    _FAR_ROWS[up_k] = (rows, ordered)
    return ordered


_FAR_ROWS = WeakIdKeyDictionary()  # factor -> (its _per_head rows, those rows in the far loop's rank order)
_PER_HEAD = WeakIdKeyDictionary()  # factor -> (its _version, blocks, [kv_heads, range, head_dim] float32)


def _per_head(factor, kv_heads, blocks):
    """The rows of a factor B [rank, kv_heads * head_dim] (B_v, or B_k for windowed RoPE) each KV head reads, as one
    float32 [kv_heads, range, head_dim] tensor: its block's rows (head- or group-wise factors) or all of them
    (joint). Built once per tensor version: a decode step would otherwise spend a gather and a cast per layer on
    it."""
    cached = _PER_HEAD.get(factor)
    if cached is not None and cached[:2] == (factor._version, blocks):
        return cached[2]
    rank = factor.shape[0]
    up = factor.float().view(rank, kv_heads, -1)
    if blocks > 1:  # each KV head's own block of rows
        heads = torch.arange(kv_heads, device=up.device)
        up = up.view(blocks, rank // blocks, kv_heads, up.shape[-1])[heads // (kv_heads // blocks), :, heads]
    else:
        up = up.transpose(0, 1)
    up = up.contiguous()
    _PER_HEAD[factor] = (factor._version, blocks, up)
    return up
