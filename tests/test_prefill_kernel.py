"""Triton prefill attention against `reference.latent_attention`, on caches written by the reference write op (the
real byte layout: earlier chunks, then this step's own write), over drawn shapes, on both of the launcher's paths:
the flash-style kernel, and the rebuild path (keys and value latents rebuilt into dense buffers, then SDPA). Runs on
CUDA when present, else on CPU under Triton's interpreter."""
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
from test_kernels import DEVICE, FP16_TOLERANCE, build_case, draw_layout, narrow_blocks_read_whole  # noqa: E402

# additive masks of finfo.min: the kernel's exponent (s - m) log2 e overflows to -inf there, as meant (weight 0)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")

SETTINGS = settings(max_examples=int(os.environ.get("LRKV_KERNEL_EXAMPLES", 80)), deadline=None, derandomize=True,
                    print_blob=True)


def build_prefill_case(*, earlier, tokens, **case):
    """`build_case` for a step of `tokens` new tokens after `earlier` cached ones."""
    return build_case(length=earlier + tokens, tokens=tokens, **case)


def check(kwargs, path=None):
    if narrow_blocks_read_whole(kwargs):  # refused, as by the decode kernel ("auto" runs the reference op)
        with pytest.raises(NotImplementedError, match="would cross the blocks"):
            triton_prefill.prefill_attention_with(path, **kwargs)
        return
    # the oracle runs on CPU: there SDPA's softmax over a row of finfo.min (a left-padded row's padding queries under
    # an additive mask) attends uniformly, as plain softmax does and the kernel does; CUDA's SDPA returns zeros
    expected = reference.latent_attention(**{name: value.cpu() if isinstance(value, torch.Tensor) else value
                                             for name, value in kwargs.items()}).to(DEVICE)
    actual = triton_prefill.prefill_attention_with(path, **kwargs)
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


@settings(SETTINGS, max_examples=max(1, SETTINGS.max_examples // 2))
@given(case=prefill_cases())
def test_rebuild_path_matches_the_reference(case):
    """The same drawn steps on the rebuild path, which takes no additive mask, and windowed RoPE only in half
    precision where the mask shows what causality shows (`rebuild_refusal`): additive masks become boolean ones, and
    windowed draws run in float16 or bfloat16 without left padding or random columns per head."""
    if case["rope_window"]:
        case = {**case, "padding": False, "blind_row": False,
                "mask_shape": "causal" if case["mask_shape"] == "per_head" else case["mask_shape"],
                "dtype": torch.float16 if case["dtype"] == torch.float32 else case["dtype"]}
    check(build_prefill_case(**{**case, "mask": "bool" if case["mask"] == "additive" else case["mask"]}), "rebuild")


@pytest.mark.parametrize("path", ["kernel", "rebuild"])
@pytest.mark.parametrize("v_bits, v_block_rank, v_group", [(4, 32, 16), (3, 128, 32)])
def test_values_the_output_projection_absorbed_are_read_whole_from_their_stored_blocks(path, v_bits, v_block_rank,
                                                                                     v_group):
    """As for the decode kernel (`test_kernels.py`): up_v None over head-wise values stored by blocks, each KV head
    reading every block chunk by chunk, on both paths (the rebuild path in float16, as it runs)."""
    kwargs = build_prefill_case(**{**BASE, "absorb": True, "by_blocks": True, "v_bits": v_bits,
                                   "v_block_rank": v_block_rank, "v_group": v_group,
                                   "dtype": torch.float16 if path == "rebuild" else torch.float32})
    assert kwargs["up_v"] is None and kwargs["latent_v"].dim() == 4 and kwargs["latent_v"].shape[2] == 2
    check(kwargs, path)


def test_the_launcher_takes_the_rebuild_path_for_long_chunks_it_covers(monkeypatch):
    """Chunks of REBUILD_TOKENS tokens or more take the rebuild path (one read of each slot, then SDPA), shorter ones
    the kernel (with 16-bit latents, REBUILD_TOKENS_16BIT); additive masks stay on the kernel, and windowed RoPE too
    where the rebuild path's flash-attention passes cannot take it (float32, left padding, positions that do not run
    on slot to slot): forcing the rebuild path on them says why not, and the launcher's own choice falls back to the
    kernel."""
    long = build_prefill_case(**{**BASE, "earlier": 5, "tokens": triton_prefill.REBUILD_TOKENS})
    query, mask = long["query"], long["attn_mask"]
    assert triton_prefill.choose_path(query, mask, 0, 4, 3) == "rebuild"
    assert triton_prefill.choose_path(query, mask, 0, 16, 3) == "rebuild"
    assert triton_prefill.choose_path(query[:, :, :-1], mask, 0, 4, 3) == "kernel"
    assert triton_prefill.choose_path(query, mask, 0, 16, 16) == "kernel"
    sixteen_bit = query.new_empty(2, 6, triton_prefill.REBUILD_TOKENS_16BIT, 64)
    assert triton_prefill.choose_path(sixteen_bit, mask, 0, 16, 16) == "rebuild"
    assert triton_prefill.choose_path(query, mask, 16, 4, 3) == "kernel"
    assert triton_prefill.choose_path(query, mask.float(), 0, 4, 3) == "kernel"
    assert triton_prefill.choose_path(query.half(), None, 16, 4, 3) == "rebuild"
    assert triton_prefill.choose_path(query, None, 16, 4, 3) == "kernel"
    check(long)  # the launcher's own choice, the rebuild path
    windowed = dict(BASE, rope_window=6, earlier=5, tokens=triton_prefill.REBUILD_TOKENS, dtype=torch.float16,
                    mask="none", padding=False)
    for change, what in ((dict(dtype=torch.float32), "in torch.float32"),
                         (dict(mask="bool", padding=True, pads=[3, 0]), "left padding")):
        with pytest.raises(NotImplementedError, match=what):
            triton_prefill.prefill_attention_with("rebuild", **build_prefill_case(**{**windowed, **change}))
    length = windowed["earlier"] + windowed["tokens"]
    jumping = build_prefill_case(**windowed)
    jumping["positions"][:, 3:] += 100  # a gap in the positions: a window of positions is no longer one of slots
    late_gap = build_prefill_case(**windowed)
    late_gap["positions"][:, length - 1] += 1  # at the last slot written
    with_mask = dict(windowed, mask="bool", mask_shape="causal")
    own_hidden = build_prefill_case(**with_mask)
    own_hidden["attn_mask"][:, :, 4, windowed["earlier"] + 4] = False  # one query's own slot
    narrow = build_prefill_case(**with_mask)
    narrow["attn_mask"] = narrow["attn_mask"][..., :length - 2]
    for kwargs, what in ((jumping, "do not run on"), (late_gap, "do not run on"),
                         (own_hidden, "hides slots causality shows"), (narrow, f"{length - 2} columns for {length}")):
        with pytest.raises(NotImplementedError, match=what):
            triton_prefill.prefill_attention_with("rebuild", **kwargs)
    monkeypatch.setattr(triton_prefill, "_capturing", lambda query: True)  # no length on the host: the kernel
    assert triton_prefill.choose_path(query.half(), None, 16, 4, 3) == "kernel"
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(triton_prefill, "_windowed_attention", lambda *args: calls.append(args))
    check(jumping)  # the kernel, the launcher's own choice after the rebuild path's refusal
    check(own_hidden)
    assert not calls
    additive = build_prefill_case(**{**BASE, "mask": "additive"})
    with pytest.raises(NotImplementedError, match="additive mask"):
        triton_prefill.prefill_attention_with("rebuild", **additive)


@pytest.mark.parametrize("mask", ["none", "bool"])
@pytest.mark.parametrize("earlier", [0, 45])
def test_rebuild_path_under_cuda_graph_capture_reads_nothing_on_the_host(monkeypatch, mask, earlier):
    """Under capture (mode="reduce-overhead") the rebuild path cannot read the length: its buffers span the cache's
    capacity (here 2 spare slots past the length), zeroed, and the mask hides what lies past the length, built on the
    device from the length tensor."""
    monkeypatch.setattr(triton_prefill, "_capturing", lambda query: True)
    kwargs = build_prefill_case(**{**BASE, "earlier": earlier, "mask": mask, "padding": mask != "none"})
    expected = reference.latent_attention(**kwargs)
    real_visible = triton_prefill._visible

    def visible(attn_mask, tokens, slots, written, length):
        assert written is None and slots == kwargs["positions"].shape[1] > int(kwargs["length"])
        return real_visible(attn_mask, tokens, slots, written, kwargs["length"])

    monkeypatch.setattr(triton_prefill, "_visible", visible)
    actual = triton_prefill.prefill_attention_with("rebuild", **kwargs)
    torch.testing.assert_close(actual, expected, **TOLERANCE[torch.float32])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU; on CPU the test above runs the capture branch of the "
                    "rebuild path under the interpreter")
def test_a_captured_cuda_graph_replays_the_rebuild_path():
    """A long chunk (the rebuild path) captured into a CUDA graph after one warm-up call, then replayed with another
    cache, queries and new latents (the model's factors stay): the replay matches the reference on them."""
    kwargs = build_prefill_case(**{**BASE, "dtype": torch.float16, "tokens": triton_prefill.REBUILD_TOKENS,
                                   "mask": "none", "padding": False})
    assert triton_prefill.choose_path(kwargs["query"], None, 0, kwargs["k_bits"], kwargs["v_bits"]) == "rebuild"
    triton_prefill.prefill_attention(**kwargs)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_prefill.prefill_attention(**kwargs)
    other = build_prefill_case(**{**BASE, "dtype": torch.float16, "tokens": triton_prefill.REBUILD_TOKENS,
                                  "mask": "none", "padding": False, "seed": 7})
    for name in ("query", "latent_k", "k_scale", "k_zero", "k_exact", "latent_v", "v_scale", "v_zero", "v_exact",
                 "positions", "new_k", "new_v"):
        kwargs[name].copy_(other[name])
    graph.replay()
    expected = reference.latent_attention(**{name: value.cpu() if isinstance(value, torch.Tensor) else value
                                             for name, value in kwargs.items()}).to(DEVICE)
    torch.testing.assert_close(out.float(), expected.float(), **FP16_TOLERANCE)


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


@pytest.mark.parametrize("mask", ["none", "bool"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("earlier, tokens, window", [(0, 17, 5), (45, 13, 10), (3, 9, 8), (30, 8, 40), (0, 6, 1)])
def test_windowed_rope_on_the_rebuild_path(dtype, earlier, tokens, window, mask):
    """The rebuild path under windowed RoPE: a sliding-window pass over the turned keys and a causal pass over the
    unturned keys of the slots `window` or more behind, merged: a prompt, a chunk after earlier ones, a window reaching
    past the chunk's first queries' slots, one longer than everything (no far slot), and a window of one slot; without
    a mask, and with the boolean causal mask over the cache's capacity that transformers passes."""
    check(build_prefill_case(**{**BASE, "dtype": dtype, "earlier": earlier, "tokens": tokens, "rope_window": window,
                                "mask": mask, "padding": False, "start_position": 3000}), "rebuild")


@pytest.mark.parametrize("kv_heads, group_heads", [(1, 1), (1, 4), (2, 4)])
def test_windowed_rebuild_path_over_gqa_ratios(kv_heads, group_heads):
    """One KV head per query head, and four query heads to a KV head, with one or two KV heads (the flash passes take
    the KV heads as they are)."""
    check(build_prefill_case(**{**BASE, "dtype": torch.bfloat16, "kv_heads": kv_heads, "group_heads": group_heads,
                                "k_blocks": kv_heads, "v_blocks": kv_heads, "earlier": 9, "tokens": 11,
                                "rope_window": 7, "mask": "bool", "padding": False}), "rebuild")


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("v_blocks, v_block_rank, v_bits", [(2, 72, 3), (1, 136, 4), (2, 70, 16), (2, 20, 16)])
def test_windowed_rebuild_path_with_value_latents_of_other_widths(v_blocks, v_block_rank, v_bits, absorb):
    """Value latents wider or narrower than head_dim (64), some at widths not a multiple of 8: flash attention takes
    one width for queries, keys and values, a multiple of 8, so all go in zero-padded to it."""
    check(build_prefill_case(**{**BASE, "dtype": torch.float16, "v_blocks": v_blocks, "v_block_rank": v_block_rank,
                                "v_bits": v_bits, "absorb": absorb, "rope_window": 10, "mask": "bool",
                                "padding": False, "start_position": 3000}), "rebuild")


def test_a_mask_broadcast_over_the_batch_and_the_heads():
    kwargs = build_prefill_case(**{**BASE, "mask": "additive", "padding": False})
    kwargs["attn_mask"] = kwargs["attn_mask"][:1]
    check(kwargs)


@pytest.mark.parametrize("blind_row", [False, True])
def test_the_rebuild_path_zeroes_the_queries_a_mask_hides_everything_from(monkeypatch, blind_row):
    """A query whose boolean mask hides every slot attends to nothing (zeros, as in the reference), whatever SDPA
    returns there: CUDA's SDPA (torch 2.11 on an H200) gave finite junk. Here SDPA returns 7s in those rows."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def junk_where_blind(*args, attn_mask=None, **kwargs):
        context = sdpa(*args, attn_mask=attn_mask, **kwargs)
        return context if attn_mask is None else context.masked_fill(~attn_mask.any(-1, keepdim=True), 7.0)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", junk_where_blind)
    kwargs = build_prefill_case(**{**BASE, "dtype": torch.float32, "earlier": 0, "tokens": 5, "mask": "bool",
                                   "mask_shape": "padding", "padding": False, "blind_row": blind_row, "spare": 0})
    hidden = ~kwargs["attn_mask"].any(-1)  # [batch, 1, 1]
    assert hidden.any() == blind_row
    check(kwargs, "rebuild")


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


@pytest.mark.parametrize("path", [None, "rebuild"])
@pytest.mark.parametrize("layout", [
    dict(v_bits=8),  # 4-bit keys of 24 channels a head, 8-bit values of 40, groups of 8
    dict(k_block_rank=64, v_block_rank=128, k_group=32, v_group=32, dtype=torch.float16)])  # the budget plan's
def test_codes_stored_by_blocks_on_both_paths(path, layout):
    """Codes, scales and zero points stored head-major (`quantize.by_blocks`, as LatentCache stores head-wise sides):
    the prefill kernel and the rebuild path read what the reference reads, in a chunk after earlier ones."""
    kwargs = build_prefill_case(**{**BASE, **layout, "by_blocks": True})
    assert kwargs["latent_k"].dim() == kwargs["latent_v"].dim() == 4
    check(kwargs, path)
