"""Triton lowering of `latent_write`: input checks and one launch for both sides (`kernels/latent_write.py`).

`latent_write(**kwargs)` takes the keyword arguments of `reference.latent_write` and writes what it writes (the
same bytes); anything it does not cover raises NotImplementedError naming what, before writing anything, so the
caller can run the reference instead. Like the reference it never reads the device on the host: the length stays
a tensor, and a context longer than the cache is a device assertion on the GPU (`reference._assert_room`) on what
the kernel found, which then writes nothing (the assertion left out where `device_check` is False: a graph's later
writes, `ops.latent_write`).
"""
import os

import torch
import triton

from lrkv_compile.kernels import latent_write as kernels
from . import ahead, quantize
from .launch import launch
from .reference import _assert_room, _check_room


def _side_constants(name, latent, scale, zero, new, bits, group, axis, outliers):
    """The kernel's constants for one side, or NotImplementedError for a layout it does not write."""
    rank = new.shape[-1]
    runs = triton.next_power_of_2(max(1, -(-rank // 8)))
    if bits != 16:
        if axis != "token":
            raise NotImplementedError(f"{name}_axis={axis!r}: the Triton write quantizes per token only")
        if outliers:
            raise NotImplementedError(f"{name}_outliers={outliers}: the Triton write keeps no float16 outlier channels")
        if group % 8 or group & (group - 1) or rank % group or group > 8 * runs:
            raise NotImplementedError(f"{name}_group={group} for rank {rank}: the Triton write takes groups of a "
                                      "power of two channels, at least 8, that divide the rank")
    if latent.stride(-1) != 1 or new.stride(-1) != 1:
        raise NotImplementedError(f"latent_{name} or new_{name} has a non-contiguous last axis")
    blocks = latent.shape[2] if latent.dim() == 4 else 1  # stored apart (`quantize.by_blocks`), or rows
    if blocks > 1 and (quantize.stored_blocks(bits, group, axis, outliers, rank, blocks) != blocks
                       or scale.dim() != 4 or scale.shape[2] != blocks or scale.stride() != zero.stride()):
        raise NotImplementedError(f"latent_{name} stored in {blocks} blocks with scales {tuple(scale.shape)}: the "
                                  "Triton write takes quantized blocks of whole bytes and groups "
                                  "(`quantize.stored_blocks`), each with its scales, zero points laid out as the "
                                  "scales")
    return dict(RANK=rank, RUNS=runs, BITS=bits, GROUP=group if bits != 16 else 8,
                STORED=rank // blocks if blocks > 1 else 0)


def latent_write(*, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, positions, new_k, new_v,
                 new_positions, length, k_bits, k_group, k_sinks, k_axis, k_outliers, v_bits, v_group, v_sinks, v_axis,
                 v_outliers, rope_rows=None, new_cos=None, new_sin=None, device_check=True) -> None:
    """`reference.latent_write` on the Triton write kernel."""
    if new_k.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise NotImplementedError(f"{new_k.device.type} tensors: the Triton write runs on CUDA (or with "
                                  "TRITON_INTERPRET=1)")
    if new_cos is not None:
        raise NotImplementedError("RoPE rows stored per token: the Triton write stores positions only")
    batch, tokens = new_k.shape[0], new_k.shape[1]
    sides = [("k", latent_k, k_scale, k_zero, k_exact, new_k, k_bits, k_group, k_sinks, k_axis, k_outliers),
             ("v", latent_v, v_scale, v_zero, v_exact, new_v, v_bits, v_group, v_sinks, v_axis, v_outliers)]
    constants_by_side = [_side_constants(name, latent, scale, zero, new, bits, group, axis, outliers)
                         for name, latent, scale, zero, _, new, bits, group, _, axis, outliers in sides]
    if any(tokens > side[1].shape[1] for side in sides):
        raise NotImplementedError(f"{tokens} tokens into a ring of fewer slots: the Triton write writes each token")
    slots = {side[1].shape[1] for side in sides}
    if len(slots) > 1:
        raise NotImplementedError(f"latent_k and latent_v of {sorted(slots)} slots: the Triton write takes one ring "
                                  "or cache length for both")
    length = torch.as_tensor(length, device=positions.device)
    capacity = positions.shape[1]
    checked = _check_room(length, tokens, capacity, batch, latent_k.shape[0])
    if new_positions is not None:
        new_positions = new_positions.reshape(new_positions.shape[0], tokens)
    arguments, constants = [], {}
    for (name, latent, scale, zero, exact, new, bits, group, sinks, _, _), const in zip(sides, constants_by_side):
        new = new.reshape(batch, tokens, -1)
        quantized = bits != 16
        by_blocks = bool(const["STORED"])  # stored apart (`quantize.by_blocks`), checked by _side_constants
        arguments += [
            new, new.stride(0), new.stride(1), latent, latent.stride(0), latent.stride(1),
            latent.stride(2) if by_blocks else 0, scale if quantized else latent, zero if quantized else latent,
            scale.stride(0) if quantized else 0, scale.stride(1) if quantized else 0,
            scale.stride(2) if by_blocks else 0,
            exact if exact.numel() else latent, exact.stride(0) if exact.numel() else 0,
            exact.stride(1) if exact.numel() else 0, sinks, exact.shape[1] - sinks if exact.numel() else 0]
        constants.update({f"{name.upper()}_{key}": value for key, value in const.items()},
                         **{f"{name.upper()}_HAS_EXACT": bool(exact.numel())})
    write_positions = new_positions is not None
    source = new_positions if write_positions else positions
    # whether the context fits, from the kernel, for the device assertion (the host checked it where it could)
    room = torch.empty((), dtype=torch.int8, device=positions.device)
    launch(kernels.latent_write_kernel, (batch, tokens, 2), (
        *arguments, length, tokens, slots.pop(), capacity, room, positions, positions.stride(0), source,
        source.stride(0) if source.shape[0] > 1 else 0, source.stride(1) if write_positions else 0),
        dict(**constants, WRITE_POSITIONS=write_positions))
    if not checked and device_check and not ahead.compiling():  # compiling ahead launches nothing: no answer
        _assert_room(room, capacity)
