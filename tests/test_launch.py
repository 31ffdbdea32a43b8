"""`lowering.launch`: a kernel's later launches go to the compiled kernel Triton returned for the same specialization
of the arguments, and any change Triton would compile anew for goes through Triton again. A stand-in kernel records
the launches (the GPU tests run the real kernels through it)."""
import types

import pytest
import torch

pytest.importorskip("triton", reason="the launch helper needs the triton package")
from lrkv_compile.lowering import launch  # noqa: E402


class Binary:
    """What Triton's launch returns: a compiled kernel, launched with every parameter by position."""

    def __init__(self, names, launches):
        self.src = types.SimpleNamespace(signature={name: "" for name in names})
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("direct", grid, args))


class Kernel:
    """A JIT kernel of three runtime parameters and two constexprs, one with a default."""

    def __init__(self, binary_names=None):
        self.params = [types.SimpleNamespace(name=name, is_constexpr=constexpr, has_default=default is not None,
                                             default=default)
                       for name, constexpr, default in (("x_ptr", False, None), ("n", False, None),
                                                        ("scale", False, None), ("BLOCK", True, None),
                                                        ("CHECK", True, 1024))]
        self.arg_names = [p.name for p in self.params]
        self.launches = []
        self.binary_names = binary_names or self.arg_names

    def __getitem__(self, grid):
        def run(*args, **constants):
            self.launches.append(("jit", grid, args, constants))
            return Binary(self.binary_names, self.launches)
        return run


@pytest.fixture(autouse=True)
def _compiled_launches(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_the_same_specialization_launches_the_compiled_kernel_directly():
    kernel, x = Kernel(), torch.zeros(64, dtype=torch.float16)
    launch.launch(kernel, (4, 2), (x, 32, 0.5), dict(BLOCK=16, num_warps=4))
    launch.launch(kernel, (4, 2), (x, 32, 0.25), dict(BLOCK=16, num_warps=4))  # a float is not specialized
    assert [entry[0] for entry in kernel.launches] == ["jit", "direct"]
    assert kernel.launches[1][1] == (4, 2, 1)  # the compiled kernel takes three grid dimensions
    assert kernel.launches[1][2][1:] == (32, 0.25, 16, 1024)  # the constexprs after, their defaults filled in


@pytest.mark.parametrize("change", ["misaligned", "aligned elsewhere", "dtype", "one", "odd", "bool"])
def test_what_triton_specializes_on_goes_through_triton_again(change):
    """A tensor's address (modulo 256: finer than Triton's 16-byte alignment) or dtype, an integer's value (Triton
    specializes 1 and multiples of 16; the key takes the value), a bool where an integer was (True == 1 in Python;
    Triton compiles them apart): a launch that differs goes through Triton, and the next one like it is direct."""
    kernel, x = Kernel(), torch.zeros(64, dtype=torch.float16)
    launch.launch(kernel, (1,), (x, 1, 0.5), dict(BLOCK=16))
    other = {"misaligned": (x[1:], 1, 0.5), "aligned elsewhere": (x[8:], 1, 0.5), "dtype": (x.float(), 1, 0.5),
             "one": (x, 2, 0.5), "odd": (x, 33, 0.5), "bool": (x, True, 0.5)}[change]
    launch.launch(kernel, (1,), other, dict(BLOCK=16))
    launch.launch(kernel, (1,), other, dict(BLOCK=16))
    assert [entry[0] for entry in kernel.launches] == ["jit", "jit", "direct"]


def test_a_compiled_kernel_of_other_parameters_keeps_the_triton_launch():
    """Triton before 3.3 compiles kernels that take only the runtime arguments: every launch goes through Triton."""
    kernel, x = Kernel(binary_names=["x_ptr", "n", "scale"]), torch.zeros(64)
    for _ in range(3):
        launch.launch(kernel, (1,), (x, 32, 0.5), dict(BLOCK=16))
    assert [entry[0] for entry in kernel.launches] == ["jit"] * 3


def test_arguments_the_key_does_not_cover_keep_the_triton_launch():
    kernel, x = Kernel(), torch.zeros(64)
    for _ in range(2):
        launch.launch(kernel, (1,), (x, (1, 32), 0.5), dict(BLOCK=16))
    assert [entry[0] for entry in kernel.launches] == ["jit"] * 2


def test_the_interpreter_keeps_the_triton_launch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel, x = Kernel(), torch.zeros(64)
    for _ in range(2):
        launch.launch(kernel, (1,), (x, 32, 0.5), dict(BLOCK=16))
    assert [entry[0] for entry in kernel.launches] == ["jit"] * 2


def test_tensor_descriptors_launch_directly_and_a_new_block_goes_through_triton_again():
    """A tensor descriptor's dtype and block are compiled in (its shape and strides are values at launch): the same
    block over another tensor launches the compiled kernel, a new block or dtype goes through Triton."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def descriptor(tensor, block):
        return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block)

    kernel = Kernel()
    x, y = torch.zeros(2, 64, 32, dtype=torch.float16), torch.zeros(4, 128, 32, dtype=torch.float16)
    for args in [(descriptor(x, [1, 16, 32]), 1, 0.5), (descriptor(y, [1, 16, 32]), 1, 0.5),
                 (descriptor(y, [1, 64, 32]), 1, 0.5), (descriptor(y.float(), [1, 64, 32]), 1, 0.5),
                 (None, 1, 0.5), (None, 1, 0.5)]:
        launch.launch(kernel, (1,), args, dict(BLOCK=16))
    assert [entry[0] for entry in kernel.launches] == ["jit", "direct", "jit", "jit", "jit", "direct"]
