"""The Triton latent write against `reference.latent_write`: the same bytes in every cache buffer (codes, scales,
zero points, exact sinks and window ring, positions) over a prefill and decode steps, for each bit width, group,
dtype and a ring shorter than the context. Runs on CUDA when present, else on CPU under Triton's interpreter."""
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles anything: the kernels then run on CPU tensors
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from lrkv_compile.lowering import ahead, launch, reference, triton_write  # noqa: E402
from test_kernels import _side_buffers  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# the cache buffers a write takes, in the order `_buffers` returns them
BUFFERS = ("latent_k", "k_scale", "k_zero", "k_exact", "latent_v", "v_scale", "v_zero", "v_exact", "positions")


def _buffers(batch, capacity, context, rank_k, rank_v, layout, dtype, generator, blocks=1):
    """Both sides' cache buffers, filled with random bytes (so what a write must not touch is checked too), and
    the positions; quantized sides stored by `blocks` blocks where they can be (`test_kernels._side_buffers`)."""
    sides = [_side_buffers(batch, capacity, rank, layout[f"{side}_bits"], layout[f"{side}_group"],
                           layout[f"{side}_sinks"], layout["window"], "token", 0, dtype, blocks)
             for side, rank in (("k", rank_k), ("v", rank_v))]
    for tensor in sides[0] + sides[1]:
        if tensor.numel():
            tensor.copy_(torch.randint(0, 256, tensor.shape, generator=generator, dtype=torch.uint8)
                         if tensor.dtype == torch.uint8 else torch.randn(tensor.shape, generator=generator))
    positions = torch.randint(0, 1000, (batch, context), generator=generator, dtype=torch.int32)
    return [tensor.to(DEVICE) for tensor in sides[0] + sides[1] + [positions]]


@pytest.mark.parametrize("k_bits, v_bits, group, sinks, window", [
    (16, 16, 8, 0, 0), (4, 3, 32, 4, 0), (8, 2, 8, 1, 3), (3, 4, 16, 0, 5), (2, 16, 8, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("blocks", [1, 2])
def test_the_triton_write_stores_the_reference_bytes(k_bits, v_bits, group, sinks, window, dtype, ring, blocks):
    """blocks: 2, each side's codes stored by two blocks where its layout allows (8-bit keys and 2- and 4-bit values
    in groups of 8 and 16, 3-bit values of 128 channels a block), as rows elsewhere."""
    generator = torch.Generator().manual_seed(k_bits * 100 + v_bits + group)
    batch, max_batch, context, rank_k = 2, 3, 24, 32
    rank_v = 256 if blocks == 2 and v_bits == 3 else 64
    capacity = 16 if ring else context  # a sliding-window layer's ring: index i at slot i % 16
    layout = dict(k_bits=k_bits, k_group=group, k_sinks=sinks if k_bits != 16 else 0, k_axis="token", k_outliers=0,
                  v_bits=v_bits, v_group=group, v_sinks=sinks if v_bits != 16 else 0, v_axis="token", v_outliers=0)
    buffers = _buffers(max_batch, capacity, context, rank_k, rank_v, dict(layout, window=window), dtype, generator,
                       blocks)
    # by blocks wherever a side is quantized and blocks were asked for (16-bit sides are always rows)
    assert any(tensor.dim() == 4 for tensor in buffers) == (blocks == 2 and (k_bits, v_bits) != (16, 16))
    expected = [tensor.clone() for tensor in buffers]
    start = 0
    for tokens in (7, 1, 1, 9, 1):  # a prompt, decode steps, a chunk that wraps the ring, one more step
        new_k = torch.randn(batch, tokens, rank_k, generator=generator).to(dtype).to(DEVICE)
        new_v = torch.randn(batch, tokens, rank_v, generator=generator).to(dtype).to(DEVICE)
        new_v[:, :, :8] = 0.5  # a constant group: scale 0, codes 0
        new_positions = (start + torch.arange(tokens)[None]).to(DEVICE)
        arguments = dict(new_k=new_k, new_v=new_v, new_positions=new_positions,
                         length=torch.tensor(start, device=DEVICE), **layout)
        reference.latent_write(*expected[:8], expected[8], **arguments)
        triton_write.latent_write(**dict(zip(BUFFERS, buffers)), **arguments)
        start += tokens
        for name, got, want in zip(BUFFERS, buffers, expected):
            assert torch.equal(got, want), f"{name} differs after {start} tokens"


def test_the_write_op_passes_opcheck():
    """lrkv::latent_write is defined through the low-level torch.library API (`ops._direct_op`): PyTorch's op checks
    find that it writes exactly the buffers its schema says it mutates, and that its fake and dispatch agree."""
    generator = torch.Generator().manual_seed(0)
    layout = dict(k_bits=4, k_group=32, k_sinks=4, k_axis="token", k_outliers=0, v_bits=3, v_group=32, v_sinks=4,
                  v_axis="token", v_outliers=0)
    buffers = _buffers(3, 24, 24, 32, 64, dict(layout, window=2), torch.float16, generator)
    arguments = dict(zip(BUFFERS, buffers),
                     new_k=torch.randn(2, 3, 32, generator=generator).half().to(DEVICE),
                     new_v=torch.randn(2, 3, 64, generator=generator).half().to(DEVICE),
                     new_positions=torch.arange(3, device=DEVICE)[None].repeat(2, 1),
                     length=torch.tensor(5, device=DEVICE), **layout, rope_rows=buffers[0][:0], new_cos=None,
                     new_sin=None, implementation="auto")
    results = torch.library.opcheck(torch.ops.lrkv.latent_write.default, (), arguments)
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("change, what", [
    (dict(k_axis="channel"), "k_axis='channel'"), (dict(v_outliers=8), "v_outliers=8"),
    (dict(k_group=12), "k_group=12"), (dict(tokens=20), "ring of fewer slots")])
def test_what_the_write_does_not_cover_raises_not_implemented(change, what):
    layout = dict(k_bits=4, k_group=8, k_sinks=0, k_axis="token", k_outliers=0, v_bits=4, v_group=8, v_sinks=0,
                  v_axis="token", v_outliers=0)
    layout.update({name: value for name, value in change.items() if name != "tokens"})
    buffers = _buffers(1, 16, 32, 24 if "k_group" in change else 32, 32, dict(layout, window=0), torch.float16,
                       torch.Generator().manual_seed(0))
    tokens = change.get("tokens", 1)
    with pytest.raises(NotImplementedError, match=what):
        triton_write.latent_write(
            **dict(zip(BUFFERS, buffers)),
            new_k=torch.randn(1, tokens, 24 if "k_group" in change else 32, device=DEVICE),
            new_v=torch.randn(1, tokens, 32, device=DEVICE), new_positions=None, length=torch.tensor(0, device=DEVICE),
            **layout)


@pytest.mark.skipif(ON_GPU, reason="on the GPU a context past the cache stops the device (a device assertion: "
                                   "tests/test_cache.py); here the kernel's own check runs under the interpreter")
def test_the_write_kernel_writes_nothing_past_the_cache_and_says_so(monkeypatch):
    """The kernel compares the context with the capacity itself (the host check, which on the GPU is not made, taken
    out): a write that would pass the positions' slots stores nothing and reports 0 for the device assertion; one that
    fits reports 1."""
    layout = dict(k_bits=4, k_group=8, k_sinks=2, k_axis="token", k_outliers=0, v_bits=3, v_group=8, v_sinks=2,
                  v_axis="token", v_outliers=0)
    generator = torch.Generator().manual_seed(3)
    buffers = _buffers(2, 16, 16, 32, 32, dict(layout, window=2), torch.float16, generator)
    reported = []
    monkeypatch.setattr(triton_write, "_check_room", lambda *args: False)  # as on the GPU: not checked on the host
    monkeypatch.setattr(triton_write, "_assert_room", lambda fits, capacity: reported.append(int(fits)))
    for length, tokens, fits in ((14, 3, 0), (13, 3, 1)):
        before = [tensor.clone() for tensor in buffers]
        triton_write.latent_write(
            **dict(zip(BUFFERS, buffers)),
            new_k=torch.randn(2, tokens, 32, generator=generator).half(),
            new_v=torch.randn(2, tokens, 32, generator=generator).half(),
            new_positions=(length + torch.arange(tokens))[None], length=torch.tensor(length), **layout)
        assert reported[-1] == fits
        changed = [not torch.equal(got, was) for got, was in zip(buffers, before)]
        assert any(changed) == bool(fits), changed
    # a step's later writes (device_check False: the first write asserted it) store nothing past it either
    before = [tensor.clone() for tensor in buffers]
    triton_write.latent_write(
        **dict(zip(BUFFERS, buffers)),
        new_k=torch.randn(2, 3, 32, generator=generator).half(),
        new_v=torch.randn(2, 3, 32, generator=generator).half(),
        new_positions=torch.tensor([[14, 15, 16]]), length=torch.tensor(14), device_check=False, **layout)
    assert len(reported) == 2 and all(torch.equal(got, was) for got, was in zip(buffers, before))
    # a thread that compiles the graph's kernels ahead (`ahead`) launches nothing, so nothing is asserted either
    monkeypatch.setattr(ahead, "compiling", lambda: True)
    monkeypatch.setattr(launch.ahead, "compile_kernel", lambda *args: None)
    triton_write.latent_write(
        **dict(zip(BUFFERS, buffers)),
        new_k=torch.randn(2, 1, 32, generator=generator).half(),
        new_v=torch.randn(2, 1, 32, generator=generator).half(),
        new_positions=torch.tensor([[3]]), length=torch.tensor(3), **layout)
    assert len(reported) == 2
