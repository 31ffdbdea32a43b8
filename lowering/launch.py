"""Launching the decode path's Triton and Gluon kernels with less Python per launch.

`kernel[grid](*args, **constants)` binds and specializes every argument on each call (~60 us for the decode
kernel's 83 parameters on an H200 host, measured against ~18 us for the compiled kernel's own launch), and a decode
step launches these kernels once per layer. `launch` keeps the compiled kernel Triton returns per kernel, device, set
of constants and key of the arguments, and launches it directly from then on. The key (`_specialization`) is finer
than what Triton specializes on (checked against Triton 3.6 and 3.9): each tensor's dtype and address modulo 256,
each integer's value, bools apart from integers, a tensor descriptor's dtype and block. The direct launch skips what
Triton's own launch re-reads each time (its debug and instrumentation settings, changed globals). Under the
interpreter, for arguments the key does not cover, and with a Triton whose compiled kernels take other arguments
than the kernel's parameters (before 3.3), it is the plain launch.
"""
import os

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import ahead

_COMPILED = {}  # (kernel, device, constants, key of the arguments) -> (compiled kernel, trailing constexprs)


def _specialization(args):
    """A key of these arguments at least as fine as what Triton compiles a kernel for: a tensor's dtype and address
    modulo 256 (Triton specializes on a multiple of 16), an integer's value (Triton specializes 1 and multiples of
    16, and picks the integer type by range), a bool's value apart from the integers', a float's type (Triton never
    specializes on its value), None, a tensor descriptor's dtype and block (its shape and strides are values at
    launch). None for arguments of any other kind (tuples, constexprs): those launches stay Triton's."""
    key = []
    for value in args:
        if isinstance(value, torch.Tensor):
            key.append((value.dtype, value.data_ptr() % 256))
        elif isinstance(value, bool):
            key.append((bool, value))
        elif isinstance(value, int) or value is None:
            key.append(value)
        elif isinstance(value, float):
            key.append(float)
        elif isinstance(value, TensorDescriptor):
            key.append((TensorDescriptor, value.base.dtype, tuple(value.block_shape), value.padding))
        else:
            return None
    return tuple(key)


def launch(kernel, grid, args, constants: dict) -> None:
    """kernel[grid](*args, **constants), where `args` are the kernel's leading parameters by position and
    `constants` the rest of them (its constexprs) and the launch options, by name. On a thread that compiles
    ahead (`ahead.compiling`) it compiles the kernel for these arguments in a worker instead."""
    if ahead.compiling():
        ahead.compile_kernel(kernel, grid, args, constants)
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        kernel[grid](*args, **constants)
        return
    specialization = _specialization(args)
    if specialization is None:
        kernel[grid](*args, **constants)
        return
    key = (kernel, torch.cuda.current_device(), tuple(constants.items()), specialization)
    entry = _COMPILED.get(key)
    if entry is None:
        binary = kernel[grid](*args, **constants)
        rest = kernel.params[len(args):]
        signature = getattr(getattr(binary, "src", None), "signature", {})
        direct = (list(signature) == list(kernel.arg_names)
                  and all(parameter.is_constexpr and (parameter.name in constants or parameter.has_default)
                          for parameter in rest))
        _COMPILED[key] = (binary, [constants.get(p.name, p.default) for p in rest]) if direct else (None, None)
        return
    binary, trailing = entry
    if binary is None:
        kernel[grid](*args, **constants)
    else:
        binary[tuple(grid) + (1,) * (3 - len(grid))](*args, *trailing)  # the compiled kernel takes three dimensions
