"""The budget plan's Gluon far loop (kernels/gluon_far.py): compiled for sm_90 on any machine, checked against the
dequantized cache on a GPU."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="the Gluon far loop needs Triton's Gluon dialect")

from triton.experimental.gluon import language as gl  # noqa: E402

from lrkv_compile.kernels import gluon_far  # noqa: E402
from lrkv_compile.lowering import gluon_far as lowering_far  # noqa: E402
from lrkv_compile.lowering.gluon_far import combine, far_partials, far_splits, head_major  # noqa: E402
from lrkv_compile.lowering.quantize import dequantize, quantize  # noqa: E402

ON_GPU = torch.cuda.is_available()


def test_channel_orders_are_permutations():
    assert sorted(gluon_far.key_rank_channels()) == list(range(64))
    assert sorted(gluon_far.value_channels()) == list(range(128))


def test_the_folded_values_divide_each_row_by_the_shift_its_code_came_at():
    """FOLD takes the value codes raw, as 1024 + code * 2^shift, and divides row ch of the context by 2^shift at the
    end (`_value_shift`): the shift must be the one at which the value asm takes that row's code, output pair 8 X + i
    for row 64 X + 8 i + g (`_value_operand`)."""
    _, shifts = gluon_far._value_pairs()
    for row in range(128):
        assert gluon_far._value_shift.fn(row) == shifts[8 * (row >> 6) + ((row >> 3) & 7)]


_COMPILE = """
import json
import re
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from lrkv_compile.kernels import gluon_far
from lrkv_compile.lowering.gluon_far import REGISTERS, folds

group = int(sys.argv[2])
halves = ("kx_ptr", "vx_ptr", "q_ptr", *(("vs_ptr", "vz_ptr") if folds(group) else ()))
signature = {name: "*fp16" if name in halves else "*i32"
             for name in ("kw_ptr", "ks_ptr", "kz_ptr", "vw_ptr", "vs_ptr", "vz_ptr", "kx_ptr", "vx_ptr", "q_ptr",
                          "far_hi_ptr")}
signature["mask_ptr"] = "*i1"
signature.update({name: "*fp32" for name in ("m_ptr", "l_ptr", "acc_ptr")})
signature.update({name: "i32" for name in ("kw_sb", "kw_sh4", "ks_sb", "ks_sh", "vw_sb", "vw_sh4", "vs_sb", "vs_sh2",
                                           "kx_sb", "kx_ss", "vx_sb", "vx_ss", "mask_sb", "splits", "row_splits")})
constants = dict(kw_ss=8, ks_ss=1, vw_ss=12, vs_ss=2, mask_ss=1, KV_HEADS=8, GROUP_HEADS=group, SINKS=4,
                 HAS_MASK=sys.argv[1] == "mask", FOLD=folds(group))
signature.update({name: "constexpr" for name in constants})
names = list(signature)
aligned = {(names.index(name),): [["tt.divisibility", 16]] for name in names if name.endswith(("_ptr", "_sb"))}
source = GluonASTSource(gluon_far.far_kernel, signature,
                        constexprs={(names.index(name),): value for name, value in constants.items()}, attrs=aligned)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "maxnreg": REGISTERS})
ptx = compiled.asm["ptx"]
print(json.dumps(dict(shared=compiled.metadata.shared, shared_stores=ptx.count("st.shared"),
                      barriers=ptx.count("bar.sync"),
                      copies=len(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global", ptx)),
                      wide_copies=len(re.findall(r"cp\\.async\\.cg\\.shared\\.global.*, 0x10", ptx)),
                      products=ptx.count("mma.sync.aligned.m16n8k16"))))
"""


@pytest.mark.parametrize("mask, group", [("mask", 4), ("no mask", 4), ("mask", 1), ("no mask", 1)])
def test_compiles_for_hopper_into_two_stages_of_shared_memory(mask, group):
    """The layouts' conversions are asserted trivial at compile time, so a compile is the check that the codes
    land in the products' operands without data movement: shared memory holds the two stages of copied tiles (104
    bytes a slot) and nothing else (no st.shared: no conversion goes through it), the codes come by 16-byte copies
    (the scales by 8- and 4-byte ones), a tile waits on two barriers (the loop's and Triton's own before the first
    read of shared memory) and the loop's end on a third, with the boolean mask of a model's decode step or without
    one, at `gluon_far.REGISTERS`, for a KV head of four query heads and of one, whose loop takes the scales out of
    the codes (`gluon_far.folds`: four more products, of a row of ones, per tile; the value scales and zero points
    in one buffer of the same size; and a second copy of the loop, with its own barrier, for the splits that come out
    inf or NaN: `_overflowed`). Compiled for sm_90 in a process of its own: under Triton's interpreter (the tests' CPU
    setting) Gluon's builtins are interpreted functions, which its compiler refuses."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, mask, str(group)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    # per 64 slots 4 x (4 + 8) products (and 4 of the ones where the values fold), and the sinks' tile's 4 + 8; two
    # places issue a tile's copies, each with 10 of 16 bytes a lane (key and value codes)
    folds = lowering_far.folds(group)
    loops = 2 if folds else 1  # the folded loop's second copy (`gluon_far.SAFE_SHIFT`)
    products = loops * (4 * 4 + 4 * 8 + 4 + 8 + (4 if folds else 0))
    assert facts["shared"] == 2 * 64 * (32 + 4 + 4 + 48 + 8 + 8)
    # Triton before 3.9 (without `gl.barrier`, the name its 3.9 gives the barrier) puts a barrier between the two
    # copies into the folded values' one buffer of scales and zero points: one where the loop issues a tile, one
    # where its prologue issues the first
    fold_barriers = 2 if folds and not hasattr(gl, "barrier") else 0
    barriers = loops * (3 + fold_barriers) + (1 if folds else 0)  # and the one before the second copy's first tile
    assert facts["shared_stores"] == 0 and facts["products"] == products and facts["barriers"] == barriers
    assert facts["wide_copies"] == loops * 2 * 10 and facts["copies"] > facts["wide_copies"]


def _cache(rows, slots, kv_heads, generator):
    latent_k = torch.randn(rows, slots, kv_heads * 64, generator=generator)
    latent_v = torch.randn(rows, slots, kv_heads * 128, generator=generator)
    return (*quantize(latent_k, 4, 32), *quantize(latent_v, 3, 32))


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only (Triton's interpreter does not run them); "
                                       "the CPU compiles them for sm_90 above")
@pytest.mark.parametrize("layout", ["row", "head-major"])
@pytest.mark.parametrize("rows, slots, kv_heads, group, splits", [(2, 1024, 8, 4, 3), (3, 640, 2, 8, 4),
                                                                  (1, 64, 4, 1, 1), (2, 2048, 4, 1, 3),
                                                                  (2, 640, 3, 3, 2), (1, 512, 2, 2, 2),
                                                                  (2, 4096, 1, 7, 5)])
def test_matches_the_dequantized_cache(rows, slots, kv_heads, group, splits, layout):
    generator = torch.Generator().manual_seed(rows * slots + group)
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = (t.cuda() for t in _cache(rows, slots, kv_heads, generator))
    keys = dequantize(k_codes, k_scale, k_zero, 4, 32).view(rows, slots, kv_heads, 64)
    values = dequantize(v_codes, v_scale, v_zero, 3, 32).view(rows, slots, kv_heads, 128)
    query = (torch.randn(rows, kv_heads, group, 64, generator=generator) * 0.2).half().cuda()
    scores = torch.einsum("bhgr,bshr->bhgs", query.float(), keys)
    weights = torch.exp2(scores - scores.amax(-1, keepdim=True))
    expected = torch.einsum("bhgs,bshc->bhgc", weights, values) / weights.sum(-1)[..., None]
    cache = [k_codes, k_scale, k_zero, v_codes, v_scale, v_zero]
    if layout == "head-major":
        cache = [head_major(tensor, kv_heads) for tensor in cache]
    m, l, ctx = far_partials(*cache, query, splits)
    assert m.shape[2] == math.ceil(slots / (math.ceil(slots / splits / 64) * 64))
    got = combine(m, l, ctx)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3 * float(expected.abs().max()))


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only (Triton's interpreter does not run them); "
                                       "the CPU compiles them for sm_90 above")
@pytest.mark.parametrize("group", [4, 1])
@pytest.mark.parametrize("far_end", [128, 0])
def test_empty_splits_write_empty_partials(far_end, group):
    """Splits past the row's far slots (four splits of 64 slots over 128 far slots, or none far) read nothing and
    write what the reference writes for them: a maximum of -inf, a sum and a context of 0 (also where a KV head
    serves one query head, whose loop takes the scales out of the codes)."""
    rows, slots, kv_heads, splits = 2, 256, 2, 4
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = (
        head_major(t.cuda(), kv_heads) for t in _cache(rows, slots, kv_heads, torch.Generator().manual_seed(3)))
    queries = lowering_far.kernel_queries((torch.randn(rows, kv_heads, group, 64) * 0.2).half().cuda())
    far_hi = torch.full((rows * kv_heads,), far_end, dtype=torch.int32, device="cuda")
    outputs = []
    for launcher in (far_splits, lowering_far.reference_far_splits):
        m, l = (torch.full((rows, kv_heads, splits, group), 7.0, device="cuda") for _ in "ml")
        ctx = torch.full((rows, kv_heads, splits, group, 128), 7.0, device="cuda")
        launcher(latent_k=k_codes, k_scale=k_scale, k_zero=k_zero, k_exact=None, latent_v=v_codes, v_scale=v_scale,
                 v_zero=v_zero, v_exact=None, queries=queries, far_hi=far_hi, sinks=0, splits=splits,
                 row_splits=splits, part_max=m, part_sum=l, part_acc=ctx, kv_heads=kv_heads, group=group)
        outputs.append((m, l, ctx))
    (m, l, ctx), expected = outputs
    empty = slice(far_end // 64, None)
    assert torch.all(m[:, :, empty] == -math.inf) and torch.all(l[:, :, empty] == 0)
    assert torch.all(ctx[:, :, empty] == 0)
    torch.testing.assert_close(m, expected[0], rtol=1e-2, atol=1e-2)  # float16 codes and products against float32
    torch.testing.assert_close(l, expected[1], rtol=1e-2, atol=1e-2)
    assert (ctx - expected[2]).abs().max() <= 1e-2 * expected[2].abs().max()


def _partials(launcher, cache, queries, far_hi, rows, kv_heads, splits, group, **extra):
    """The partials (maxima, sums, contexts) that `launcher` (the far loop or its reference) writes for a head-major
    budget cache (codes, scales and zero points of the keys, then of the values), each row in `splits`; extra: sinks
    with their exact copies, a mask."""
    m, l = (torch.empty(rows, kv_heads, splits, group, device="cuda") for _ in "ml")
    ctx = torch.empty(rows, kv_heads, splits, group, 128, device="cuda")
    launcher(latent_k=cache[0], k_scale=cache[1], k_zero=cache[2], latent_v=cache[3], v_scale=cache[4],
             v_zero=cache[5], queries=queries, far_hi=far_hi, splits=splits, row_splits=splits, part_max=m,
             part_sum=l, part_acc=ctx, kv_heads=kv_heads, group=group,
             **{"k_exact": None, "v_exact": None, "sinks": 0, **extra})
    return m, l, ctx


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only (Triton's interpreter does not run them); "
                                       "the CPU compiles them for sm_90 above")
@pytest.mark.parametrize("group", [1, 4])
def test_values_past_the_folds_float16_range(group):
    """Value scales and zero points of 256 or more (a few slots of values in the thousands) and sinks' exact values
    of 512 or more: the folded loop's weights times them pass float16's range, so its splits holding them are
    computed again at a lower shift (`gluon_far.SAFE_SHIFT`) and give what the reference gives; the same cache
    through the loop that dequantizes the codes (four query heads a KV head) too."""
    rows, slots, kv_heads, splits, sinks = 2, 1024, 4, 3, 4
    generator = torch.Generator().manual_seed(5)
    latent_k = torch.randn(rows, slots, kv_heads * 64, generator=generator)
    latent_v = torch.randn(rows, slots, kv_heads * 128, generator=generator)
    latent_v[0, 300:340] *= 3000.0  # scales near 3000 * 6 / 7, zero points near -9000: the first split
    latent_v[1, 500:540] *= 3000.0  # the second split, whose retry starts from its own first tile
    cache = [head_major(t.cuda(), kv_heads) for t in (*quantize(latent_k, 4, 32), *quantize(latent_v, 3, 32))]
    assert float(cache[4].abs().max()) >= 256 and float(cache[5].abs().max()) >= 256
    k_exact = torch.randn(rows, sinks, kv_heads * 64, generator=generator).half().cuda()
    v_exact = (torch.randn(rows, sinks, kv_heads * 128, generator=generator) * 1000.0).half().cuda()
    queries = lowering_far.kernel_queries((torch.randn(rows, kv_heads, group, 64, generator=generator) * 0.2)
                                          .half().cuda())
    far_hi = torch.full((rows * kv_heads,), slots, dtype=torch.int32, device="cuda")
    (m, l, ctx), (m_ref, l_ref, ctx_ref) = (
        _partials(launcher, cache, queries, far_hi, rows, kv_heads, splits, group, sinks=sinks, k_exact=k_exact,
                  v_exact=v_exact) for launcher in (far_splits, lowering_far.reference_far_splits))
    assert torch.isfinite(ctx).all() and torch.isfinite(l).all()
    torch.testing.assert_close(m, m_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(l, l_ref, rtol=1e-2, atol=1e-2)  # the retry's weights scaled back as its context's
    got, want = ctx / l[..., None], ctx_ref / l_ref[..., None]  # each split's softmax-weighted context
    assert ((got - want).abs() <= 2e-3 * want.abs().amax(-1, keepdim=True)).all()


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only (Triton's interpreter does not run them); "
                                       "the CPU compiles them for sm_90 above")
@pytest.mark.parametrize("group", [4, 1])
@pytest.mark.parametrize("shared", [False, True])
def test_a_split_reads_its_mask_once_and_still_drops_what_it_drops(shared, group):
    """Splits of 4,096 slots, whose mask check (`kernels.gluon_far._all_kept`) takes two steps of 2,048: a slot
    dropped only in a split's second step (3,000 of split 0; 7,000-7,063 of split 1 where one mask serves every row,
    its batch stride 0) sends that split through the per-tile loads, the splits the mask keeps whole skip them, and
    every split gives what the reference gives under the same mask. The dropped slots' keys are made to dominate, so
    a split that attended them anyway would not match."""
    rows, slots, kv_heads, splits = 2, 8192, 2, 2
    generator = torch.Generator().manual_seed(7)
    latent_k = torch.randn(rows, slots, kv_heads * 64, generator=generator)
    latent_v = torch.randn(rows, slots, kv_heads * 128, generator=generator)
    # the query heads of a KV head near one direction, so that one key scores high against all of them
    queries_f = (torch.randn(rows, kv_heads, 1, 64, generator=generator)
                 + 0.1 * torch.randn(rows, kv_heads, group, 64, generator=generator)) * 0.2
    mask = torch.ones(1 if shared else rows, 1, 1, slots, dtype=torch.bool)
    dropped = [7000 + i for i in range(64)] if shared else [3000]
    mask[..., dropped] = False
    for b in range(rows):  # each dropped slot's key along its queries: far above every other score
        for h in range(kv_heads):
            latent_k[b, dropped, h * 64:(h + 1) * 64] = 40 * queries_f[b, h].mean(0)
    cache = [head_major(t.cuda(), kv_heads) for t in (*quantize(latent_k, 4, 32), *quantize(latent_v, 3, 32))]
    queries = lowering_far.kernel_queries(queries_f.half().cuda())
    far_hi = torch.full((rows * kv_heads,), slots, dtype=torch.int32, device="cuda")
    (m, l, ctx), (m_ref, l_ref, ctx_ref), (m_all, _, _) = (
        _partials(launcher, cache, queries, far_hi, rows, kv_heads, splits, group, attn_mask=attn_mask)
        for launcher, attn_mask in ((far_splits, mask.cuda()), (lowering_far.reference_far_splits, mask.cuda()),
                                    (lowering_far.reference_far_splits, None)))
    split = 1 if shared else 0
    masked_rows = slice(None) if shared else slice(0, 1)
    # the dropped slots would have raised their split's maximum: the mask matters where it drops them
    assert (m_all[masked_rows, :, split] > m_ref[masked_rows, :, split] + 10).all()
    torch.testing.assert_close(m, m_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(l, l_ref, rtol=1e-2, atol=1e-2)
    got, want = ctx / l[..., None], ctx_ref / l_ref[..., None]
    assert ((got - want).abs() <= 2e-3 * want.abs().amax(-1, keepdim=True)).all()


def test_refuses_codes_whose_head_stride_is_not_whole_16_bytes():
    """The copies move a KV head's codes 16 bytes at a time from an address they know to be aligned: a view whose
    heads lie 36 bytes apart is refused with what it needs, not read wrong."""
    rows, slots, kv_heads = 1, 64, 2
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = _cache(rows, slots, kv_heads, torch.Generator().manual_seed(0))
    padded = torch.zeros(rows, slots, kv_heads, 36, dtype=torch.uint8)
    padded[..., :32] = k_codes.view(rows, slots, kv_heads, 32)
    part = torch.empty(rows * kv_heads * 4)
    with pytest.raises(NotImplementedError, match="multiples of 16 bytes .key codes 36 bytes"):
        far_splits(latent_k=padded[..., :32], k_scale=k_scale, k_zero=k_zero, k_exact=None, latent_v=v_codes,
                   v_scale=v_scale, v_zero=v_zero, v_exact=None,
                   queries=torch.zeros(rows * kv_heads, 8, 64, dtype=torch.float16),
                   far_hi=torch.full((rows * kv_heads,), slots, dtype=torch.int32), sinks=0, splits=1, row_splits=1,
                   part_max=part, part_sum=part.clone(), part_acc=torch.empty(part.numel() * 128),
                   kv_heads=kv_heads, group=4)


def test_refuses_what_it_does_not_read():
    generator = torch.Generator().manual_seed(0)
    cache = _cache(1, 64, 2, generator)
    query = torch.zeros(1, 2, 4, 64)
    with pytest.raises(NotImplementedError, match="CUDA tensors only"):
        far_partials(*cache, query, 1)


def test_the_launch_covers_the_rows_of_the_step_not_of_the_cache(monkeypatch):
    """A cache may hold more batch rows than the step: the far loop's grid (and what it writes) follows the step's
    (far_hi and the queries), not the cache's first axis."""
    launched = []
    monkeypatch.setattr(lowering_far, "launch", lambda kernel, grid, args, constants: launched.append(grid))
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = _cache(3, 128, 2, torch.Generator().manual_seed(0))
    step_rows, kv_heads, splits = 2, 2, 4
    part = torch.empty(step_rows * kv_heads * splits * 4)
    far_splits(latent_k=k_codes, k_scale=k_scale, k_zero=k_zero, k_exact=None, latent_v=v_codes, v_scale=v_scale,
               v_zero=v_zero, v_exact=None, queries=torch.zeros(step_rows * kv_heads, 8, 64, dtype=torch.float16),
               far_hi=torch.full((step_rows * kv_heads,), 128, dtype=torch.int32), sinks=0, splits=splits,
               row_splits=splits, part_max=part, part_sum=part.clone(), part_acc=torch.empty(part.numel() * 128),
               kv_heads=kv_heads, group=4)
    assert launched == [(step_rows * kv_heads, splits)]


def test_the_launch_reads_each_layout_by_its_strides(monkeypatch):
    """The row layout's strides as the cache lays them out, and a head-major view's own: (row, KV head, slot) of the
    key words, key scales, value words and value scales, all as int32 words (the codes' head strides in fours, the
    value scales' in twos), then the slot strides as constants."""
    launched = []
    monkeypatch.setattr(lowering_far, "launch", lambda kernel, grid, args, constants: launched.append((args,
                                                                                                       constants)))
    rows, slots, kv_heads, splits = 2, 128, 2, 3
    cache = _cache(rows, slots, kv_heads, torch.Generator().manual_seed(0))
    part = torch.empty(rows * kv_heads * splits * 4)
    for sides in (cache, [head_major(tensor, kv_heads) for tensor in cache]):
        far_splits(**dict(zip(("latent_k", "k_scale", "k_zero", "latent_v", "v_scale", "v_zero"), sides)),
                   k_exact=None, v_exact=None, queries=torch.zeros(rows * kv_heads, 8, 64, dtype=torch.float16),
                   far_hi=torch.full((rows * kv_heads,), slots, dtype=torch.int32), sinks=0, splits=splits,
                   row_splits=splits, part_max=part, part_sum=part.clone(), part_acc=torch.empty(part.numel() * 128),
                   kv_heads=kv_heads, group=4)
    (row_args, row_constants), (head_args, head_constants) = launched
    # int32 words: per slot 2 x 8 of key codes, 2 x 1 of key scales, 2 x 12 of value codes, 2 x 2 of value scales
    assert row_args[14:22] == (slots * 16, 8 // 4, slots * 2, 1, slots * 24, 12 // 4, slots * 4, 2 // 2)
    assert [row_constants[name] for name in ("kw_ss", "ks_ss", "vw_ss", "vs_ss")] == [16, 2, 24, 4]
    assert head_args[14:22] == (slots * 16, slots * 8 // 4, slots * 2, slots, slots * 24, slots * 12 // 4, slots * 4,
                                slots * 2 // 2)
    assert [head_constants[name] for name in ("kw_ss", "ks_ss", "vw_ss", "vs_ss")] == [8, 1, 12, 2]


def test_the_launch_folds_for_one_query_head_a_kv_head_only(monkeypatch):
    """A KV head of one query head launches the folded loop (FOLD), its value scales and zero points as the cache's
    float16 tensors, their strides still in words as the unfolded loop's; a KV head of four, the unfolded loop over
    int32 views of the same bytes."""
    launched = []
    monkeypatch.setattr(lowering_far, "launch", lambda kernel, grid, args, constants: launched.append((args,
                                                                                                       constants)))
    rows, slots, kv_heads, splits = 2, 128, 2, 3
    cache = [head_major(tensor, kv_heads) for tensor in _cache(rows, slots, kv_heads, torch.Generator().manual_seed(0))]
    for group in (1, 4):
        part = torch.empty(rows * kv_heads * splits * group)
        far_splits(**dict(zip(("latent_k", "k_scale", "k_zero", "latent_v", "v_scale", "v_zero"), cache)),
                   k_exact=None, v_exact=None, queries=torch.zeros(rows * kv_heads, 8, 64, dtype=torch.float16),
                   far_hi=torch.full((rows * kv_heads,), slots, dtype=torch.int32), sinks=0, splits=splits,
                   row_splits=splits, part_max=part, part_sum=part.clone(), part_acc=torch.empty(part.numel() * 128),
                   kv_heads=kv_heads, group=group)
    (one_args, one_constants), (four_args, four_constants) = launched
    assert one_constants["FOLD"] and not four_constants["FOLD"]
    v_scale, v_zero = cache[4:]
    assert one_args[4] is v_scale and one_args[5] is v_zero
    assert four_args[4].dtype == four_args[5].dtype == torch.int32
    assert four_args[4].data_ptr() == v_scale.data_ptr() and four_args[5].data_ptr() == v_zero.data_ptr()
    assert one_args[14:22] == four_args[14:22]


def test_the_launch_refuses_zero_points_laid_out_unlike_their_scales(monkeypatch):
    """The kernel reads the zero points with the scales' strides: a view whose zero points lie otherwise is refused,
    not read wrong."""
    monkeypatch.setattr(lowering_far, "launch", lambda *args: pytest.fail("launched"))
    rows, slots, kv_heads = 1, 64, 2
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = _cache(rows, slots, kv_heads, torch.Generator().manual_seed(0))
    part = torch.empty(rows * kv_heads * 4)
    with pytest.raises(NotImplementedError, match="zero points laid out as the scales"):
        far_splits(latent_k=k_codes, k_scale=k_scale, k_zero=head_major(k_zero, kv_heads), k_exact=None,
                   latent_v=v_codes, v_scale=v_scale, v_zero=v_zero, v_exact=None,
                   queries=torch.zeros(rows * kv_heads, 8, 64, dtype=torch.float16),
                   far_hi=torch.full((rows * kv_heads,), slots, dtype=torch.int32), sinks=0, splits=1, row_splits=1,
                   part_max=part, part_sum=part.clone(), part_acc=torch.empty(part.numel() * 128),
                   kv_heads=kv_heads, group=4)


def test_far_rows_follow_the_factor():
    """The far queries' rows of B_k: each KV head's rows in the far loop's rank order, the same tensor while the factor
    is unchanged, rebuilt after it changes in place."""
    from lrkv_compile.lowering import triton_decode

    kv_heads = 2
    up_k = torch.block_diag(*[torch.randn(64, 128) for _ in range(kv_heads)])
    rows = triton_decode.far_rows(up_k, kv_heads, kv_heads)
    order = gluon_far.key_rank_channels()
    expected = up_k.view(kv_heads, 64, kv_heads, 128)[torch.arange(kv_heads), :, torch.arange(kv_heads)]
    torch.testing.assert_close(rows, expected[:, order], rtol=0, atol=0)
    assert triton_decode.far_rows(up_k, kv_heads, kv_heads) is rows
    up_k.mul_(2)
    torch.testing.assert_close(triton_decode.far_rows(up_k, kv_heads, kv_heads), 2 * expected[:, order], rtol=0,
                               atol=0)


@pytest.mark.parametrize("far, wave, near, splits", [
    (16, 2, 1024, (16, 2)),    # Llama-3-8B shape, 16K, batch 16: one wave of each kernel's programs
    (64, 8, 1024, (56, 8)),    # 64K, batch 4: 72 splits would pad the combine's to 128
    (64, 33, 1024, (56, 8)),   # batch 1: the near slots (17 tiles) in splits of two tiles or more
    (3, 1, 1024, (3, 1)),      # Llama-2-7B shape, batch 16: fewer programs than a wave of either
    (64, 70, 0, (63, 1)),      # no exact window and no RoPE window: the last tile alone
])
def test_far_and_near_splits_fill_a_wave_and_stay_under_the_combines_cap(far, wave, near, splits):
    from lrkv_compile.lowering.triton_decode import MAX_SPLITS, far_and_near_splits
    got = far_and_near_splits(far, wave, near, 64)
    assert got == splits
    assert sum(got) <= MAX_SPLITS and min(got) >= 1


@pytest.mark.parametrize("far_wave, rows, near, splits", [
    (4, 128, 1024, (4, 1)),    # Llama-3-8B shape, 16K, batch 16: a decode program a multiprocessor (132 of them)
    (4, 32, 1024, (16, 4)),    # 64K, batch 4
    (4, 512, 1024, (1, 1)),    # Llama-2-7B shape, 16K, batch 16: more rows than multiprocessors
    (4, 4, 1024, (56, 8)),     # batch 1 of Llama-3-8B: the near slots in splits of two tiles or more, the far
                               # loop's under the combine's cap
    (4, 1, 64, (63, 1)),       # one row: the combine's cap holds both
])
def test_beside_splits_leave_room_for_one_decode_program_a_multiprocessor(far_wave, rows, near, splits):
    """With the decode kernel beside the far loop on a second stream, the launcher asks `far_and_near_splits` for the
    far loop's splits at `far_wave` programs a multiprocessor and the decode kernel's at one (132 multiprocessors, an
    H100's): two tiles each or more, both under the combine's cap."""
    from lrkv_compile.lowering.triton_decode import MAX_SPLITS, far_and_near_splits
    got = far_and_near_splits(far_wave * 132 // rows, 132 // rows, near, 64)
    assert got == splits
    assert sum(got) <= MAX_SPLITS and min(got) >= 1


@pytest.mark.parametrize("name, programs", [("NVIDIA H100 80GB HBM3", 8), ("NVIDIA H100 PCIe", 8),
                                            ("NVIDIA H200", lowering_far.WAVE), ("NVIDIA A100-SXM4-80GB",
                                                                                lowering_far.WAVE)])
def test_the_far_loops_wave_follows_the_device(name, programs, monkeypatch):
    """The far loop's programs a multiprocessor are what was measured fastest on the device at hand (8 on an H100),
    12 elsewhere; on a CPU (the tests' stand-in) 12. With the decode kernel beside it on a second stream (an H100
    only), 4."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    lowering_far.wave.cache_clear()
    lowering_far.beside.cache_clear()
    try:
        assert lowering_far.wave(torch.device("cuda", 0)) == programs
        # an H100 runs the decode kernel beside the far loop, its far loop at 4 programs a multiprocessor
        assert lowering_far.beside(torch.device("cuda", 0)) == (4 if "H100" in name else 0)
    finally:
        lowering_far.wave.cache_clear()
        lowering_far.beside.cache_clear()
    assert lowering_far.wave(torch.device("cpu")) == lowering_far.WAVE == 12
    assert lowering_far.beside(torch.device("cpu")) == 0
