"""The Triton prefill attention kernel against `reference.latent_attention`, on caches written by the reference write
op (the real byte layout: earlier chunks, then this step's own write), over drawn shapes. Runs on CUDA when present,
else on CPU under Triton's interpreter."""
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles anything: the kernels then run on CPU tensors
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from lrkv_compile.kernels import latent_prefill  # noqa: E402
from lrkv_compile.lowering import reference, triton_prefill  # noqa: E402
from strategies import TOLERANCE  # noqa: E402
from test_kernels import DEVICE, FP16_TOLERANCE, build_case, draw_layout  # noqa: E402

# additive masks of finfo.min: the kernel's exponent (s - m) log2 e overflows to -inf there, as meant (weight 0)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")

SETTINGS = settings(max_examples=int(os.environ.get("LRKV_KERNEL_EXAMPLES", 80)), deadline=None, derandomize=True,
                    print_blob=True)


def build_prefill_case(*, earlier, tokens, **case):
    """`build_case` for a step of `tokens` new tokens after `earlier` cached ones."""
    return build_case(length=earlier + tokens, tokens=tokens, **case)


def check(kwargs):
    # the oracle runs on CPU: there SDPA's softmax over a row of finfo.min (a left-padded row's padding queries under
    # an additive mask) attends uniformly, as plain softmax does and the kernel does; CUDA's SDPA returns zeros
    expected = reference.latent_attention(**{name: value.cpu() if isinstance(value, torch.Tensor) else value
                                             for name, value in kwargs.items()}).to(DEVICE)
    actual = triton_prefill.prefill_attention(**kwargs)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual).all()
    tolerance = TOLERANCE.get(kwargs["query"].dtype, FP16_TOLERANCE)
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance)


@st.composite
def prefill_cases(draw):
    """Small prefill steps: a prompt (nothing cached) or a chunk after earlier ones, odd token counts and lengths,
    GQA ratios 1/3/4, head_dim 32/64/128 (256 on a GPU), head / group / joint factors (joint ones of two KV heads
    may be wider than a chunk of 128 latent channels), every bit width, per-token and per-channel scales, float16
    outlier channels, ranks that are not multiples of a tile, sinks and windows, left padding, boolean and
    additive masks of every shape the kernel takes."""
    kv_heads = draw(st.sampled_from([1, 2]))
    layout, quantized, mask = draw_layout(draw, kv_heads, [8, 12, 20, 32, 40, 72], [12, 16, 24, 48, 72],
                                          (1, 3, 4, 8, 16, 32))
    return dict(
        batch=draw(st.integers(1, 2)), kv_heads=kv_heads, group_heads=draw(st.sampled_from([1, 3, 4])),
        head_dim=draw(st.sampled_from([32, 64, 128] + ([256] if ON_GPU else []))),
        dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])), **layout,
        sinks=draw(st.sampled_from([0, 1, 4])) if quantized else 0,
        earlier=draw(st.sampled_from([0, 1, 7, 19, 37])), tokens=draw(st.sampled_from([1, 2, 5, 9, 17])),
        spare=draw(st.integers(0, 3)), chunks=draw(st.integers(1, 3)), mask=mask,
        mask_shape=draw(st.sampled_from(["padding", "causal", "per_head"])),
        padding=mask != "none" and draw(st.booleans()), blind_row=mask != "none" and draw(st.booleans()),
        rope=draw(st.booleans()), bias=draw(st.booleans()), absorb=draw(st.booleans()),
        rope_window=draw(st.sampled_from([0, 0, 1, 6, 30])), seed=draw(st.integers(0, 2 ** 16)))


@SETTINGS
@given(case=prefill_cases())
def test_prefill_kernel_matches_the_reference(case):
    check(build_prefill_case(**case))


BASE = dict(batch=2, kv_heads=2, group_heads=3, head_dim=64, dtype=torch.float32, k_blocks=2, v_blocks=2,
            k_block_rank=24, v_block_rank=40, k_bits=4, v_bits=3, k_group=8, v_group=8, sinks=4, window=8,
            earlier=45, tokens=13, spare=2, chunks=3, mask="bool", mask_shape="causal", padding=True, blind_row=False,
            rope=True, bias=True, absorb=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_late_positions_stay_exact(dtype):
    """Positions in the tens of thousands (RoPE angles reduced before the sine)."""
    check(build_prefill_case(**{**BASE, "dtype": dtype, "start_position": 30000}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scheme", ["head", "joint"])
def test_windowed_rope_turns_far_slots_to_the_window_edge(dtype, scheme):
    """Windowed RoPE in a chunk after earlier ones: each query scores the slots rope_window or more behind it against
    its own turn to the window's edge, the nearer ones as RoPE turns them (the edge falls inside the chunk too)."""
    blocks = {} if scheme == "head" else dict(k_blocks=1, k_block_rank=144)
    check(build_prefill_case(**{**BASE, **blocks, "dtype": dtype, "rope_window": 10, "start_position": 3000}))


def test_a_mask_broadcast_over_the_batch_and_the_heads():
    kwargs = build_prefill_case(**{**BASE, "mask": "additive", "padding": False})
    kwargs["attn_mask"] = kwargs["attn_mask"][:1]
    check(kwargs)


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("k_bits, v_bits", [(16, 16), (4, 8)])
def test_joint_factors_wider_than_a_chunk(k_bits, v_bits, absorb):
    """Keys rebuilt from two chunks of latent channels, values reduced in two chunks (programs) of channels."""
    check(build_prefill_case(**{**BASE, "k_blocks": 1, "v_blocks": 1, "k_block_rank": 144, "v_block_rank": 136,
                                "k_bits": k_bits, "v_bits": v_bits, "tokens": 6, "earlier": 21,
                                "absorb": absorb}))


def test_the_pruner_keeps_query_tiles_that_fit_the_call(monkeypatch):
    """On a GPU the autotuner times tiles of at least the KV head's query heads and at most the call's query rows
    (at least 16); the interpreter runs one small tile."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rows = {config.kwargs["BLOCK_M"] for config in latent_prefill.prune_configs(
        latent_prefill.CONFIGS, {"tokens_bucket": 4}, GROUP_HEADS=3)}
    assert rows == {16}
    rows = {config.kwargs["BLOCK_M"] for config in latent_prefill.prune_configs(
        latent_prefill.CONFIGS, {"tokens_bucket": 1024}, GROUP_HEADS=48)}
    assert rows == {64, 128}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    [config] = latent_prefill.prune_configs(latent_prefill.CONFIGS, {"tokens_bucket": 1024}, GROUP_HEADS=48)
    assert config.kwargs == {"BLOCK_M": 64, "BLOCK_S": latent_prefill.INTERPRETER_SLOTS}


class _LargestAllocation(TorchDispatchMode):
    """Records the most elements of a tensor an op allocates while it is active (views and in-place ops, such as the
    interpreter's copies of the arguments' storages, allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            self.most = max([self.most] + [leaf.numel() for leaf in tree_leaves(out)
                                           if isinstance(leaf, torch.Tensor)])
        return out


def test_a_long_chunk_allocates_no_tokens_by_slots_buffer():
    """A 32-token chunk after 224 cached tokens: the reference's float32 scores hold heads x tokens x slots
    (4 x 32 x 256) values; no tensor the launcher allocates holds even one head's tokens x slots. Measured on a
    second call: the first lets the autotuner time its configs on a GPU (its timing allocates a buffer of its own)."""
    kwargs = build_prefill_case(**{**BASE, "batch": 1, "kv_heads": 1, "group_heads": 4, "head_dim": 32, "k_blocks": 1,
                                   "v_blocks": 1, "k_block_rank": 16, "v_block_rank": 16, "earlier": 224,
                                   "tokens": 32, "mask": "none", "padding": False, "start_position": 30000})
    first = triton_prefill.prefill_attention(**kwargs)
    with _LargestAllocation() as allocations:
        actual = triton_prefill.prefill_attention(**kwargs)
    assert 0 < allocations.most < 32 * 256
    torch.testing.assert_close(actual, first, atol=0, rtol=0)
    torch.testing.assert_close(actual, reference.latent_attention(**kwargs), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("change, what", [
    (dict(head_dim=48), "head_dim=48"), (dict(k_bits=5), "k_bits=5"), (dict(inv_freq=16), "partial RoPE"),
    (dict(ring=True), "sliding-window ring"), (dict(attn_mask=True), "attn_mask of shape"),
])
def test_what_the_kernel_does_not_cover_raises_not_implemented(change, what):
    kwargs = build_prefill_case(**{**BASE, "earlier": 10, "tokens": 3, "head_dim": change.get("head_dim", 64)})
    if "k_bits" in change:
        kwargs["k_bits"] = 5
    if "inv_freq" in change:
        kwargs["inv_freq"] = kwargs["inv_freq"][:change["inv_freq"]]
    if "ring" in change:
        kwargs["positions"] = torch.cat((kwargs["positions"], kwargs["positions"]), dim=1)
    if "attn_mask" in change:
        kwargs["attn_mask"] = kwargs["attn_mask"][:, :, :, None]
    with pytest.raises(NotImplementedError, match=what):
        triton_prefill.prefill_attention(**kwargs)
