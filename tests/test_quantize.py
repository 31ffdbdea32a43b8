"""Quantized latents: packing, quantization error, rotations, byte accounting, plan files of version 1,
and the rewrite contract for quantized plans (compiled = the eager quantized reference)."""
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

import lrkv_compile as lrkv
from lrkv_compile.lowering.quantize import QUANTIZED_BITS, dequantize, pack_codes, packed_width, quantize, unpack_codes
from lrkv_compile.passes.factorize import ROTATIONS, rotate, rotation
from strategies import TOLERANCE, VOCAB, build_model

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, print_blob=True)
SMALL = dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32, attention_bias=True,
             num_hidden_layers=2, dtype=torch.float32, seed=0)


@SETTINGS
@given(bits=st.sampled_from(QUANTIZED_BITS), rank=st.integers(1, 70), rows=st.integers(1, 5), seed=st.integers(0, 99))
def test_packing_round_trips(bits, rank, rows, seed):
    codes = torch.randint(0, 2 ** bits, (rows, 3, rank), generator=torch.Generator().manual_seed(seed))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, 3, packed_width(rank, bits))
    assert torch.equal(unpack_codes(packed, bits, rank), codes.to(torch.int32))


@SETTINGS
@given(bits=st.sampled_from(QUANTIZED_BITS), group=st.sampled_from([4, 8, 16, 32]), groups=st.integers(1, 4),
       spread=st.floats(1e-3, 1e3), seed=st.integers(0, 99))
def test_quantization_error_is_at_most_half_a_step(bits, group, groups, spread, seed):
    latent = torch.randn(2, 5, group * groups, generator=torch.Generator().manual_seed(seed)) * spread
    codes, scale, zero = quantize(latent, bits, group)
    restored = dequantize(codes, scale, zero, bits, group)
    step = scale.float().repeat_interleave(group, dim=-1)
    # half a step, plus the fp16 rounding of the zero point and of the grid's top end
    bound = step / 2 + latent.abs().amax() * 2e-3 + 1e-6
    assert (restored - latent).abs().le(bound).all()


@pytest.mark.parametrize("kind", ROTATIONS)
@pytest.mark.parametrize("size", [1, 2, 3, 8, 12, 32, 40, 96, 100])
def test_rotations_are_orthogonal(kind, size):
    matrix = rotation(kind, size, seed=3)
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(size, dtype=torch.float64), atol=1e-12, rtol=0)


def test_a_fused_rotation_keeps_the_product_and_the_blocks():
    down, up = torch.randn(32, 12), torch.block_diag(torch.randn(6, 16), torch.randn(6, 16))
    rotated_down, rotated_up = rotate(down, up, "hadamard", blocks=2)
    torch.testing.assert_close(rotated_down @ rotated_up, down @ up, atol=1e-5, rtol=1e-5)
    assert rotated_up[:6, 16:].abs().max() < 1e-6 and rotated_up[6:, :16].abs().max() < 1e-6


@pytest.mark.parametrize("bits_k, bits_v", [(4, 3), (8, 2), (16, 4)])
def test_quantized_plan_through_a_latent_cache_equals_the_quantized_reference(bits_k, bits_v):
    model = build_model(SMALL)
    plan = lrkv.calibrate(model, torch.randint(0, VOCAB, (2, 24)), keep=0.5, bits_k=bits_k, bits_v=bits_v, group=8,
                          progress=False)
    assert {(s.k_layout.bits, s.v_layout.bits) for s in plan.sites} == {(bits_k, bits_v)}
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(0, VOCAB, (2, 9))
    lm = lrkv.compile(model, plan)
    with torch.no_grad():
        out = lm.generate(ids, max_new_tokens=8, do_sample=False)
        expected = reference.generate(ids, max_new_tokens=8, do_sample=False)
        stepped = lm(input_ids=ids, use_cache=False).logits  # the stock-cache form: fake-quantized latents
        full = reference(input_ids=ids, use_cache=False).logits
    assert torch.equal(out, expected)
    torch.testing.assert_close(stepped, full, **TOLERANCE[torch.float32])


def test_quantization_changes_the_numbers():
    """A 2-bit plan is not silently the 16-bit one."""
    model = build_model(SMALL)
    ids = torch.randint(0, VOCAB, (1, 9))
    plans = [lrkv.RankPlan.uniform(model, keep=1.0, bits=bits, group=8, progress=False) for bits in (16, 2)]
    with torch.no_grad():
        exact, coarse = (lrkv.compile(model, plan)(input_ids=ids, use_cache=False).logits for plan in plans)
        torch.testing.assert_close(exact, model(input_ids=ids, use_cache=False).logits, **TOLERANCE[torch.float32])
    assert (exact - coarse).abs().max() > 1e-3


def test_budget_is_what_the_cache_holds():
    model = build_model({**SMALL, "dtype": torch.bfloat16})
    plan = lrkv.RankPlan.uniform(model, keep=0.5, bits_k=4, bits_v=3, group=8, progress=False)
    cache = lrkv.LatentCache(model, plan, max_batch_size=3, max_cache_len=40)
    assert cache.nbytes() / cache.full_cache_nbytes(torch.float16) == pytest.approx(plan.budget, rel=1e-12)
    # per layer and token: K 16 channels at 4 bits = 8 B + 2 groups x 4 B; V 16 at 3 bits = 6 B + 8 B;
    # RoPE rows of one group: 2 x 16 x 2 B; a 16-bit full cache: 2 x 32 x 2 B per layer
    assert plan.budget == pytest.approx((2 * (8 + 8 + 6 + 8) + 64) / (2 * 128))


def test_version_1_plan_files_load(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    plan = lrkv.RankPlan.uniform(build_model(SMALL), keep=0.5, progress=False)
    plan.save(tmp_path / "plan.safetensors")
    with safe_open(str(tmp_path / "plan.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        meta = json.loads(handle.metadata()["lrkv_plan"])
    meta["schema_version"] = 1
    del meta["checksum"]
    for site in meta["sites"]:
        del site["k_layout"], site["v_layout"], site["k_fingerprint"], site["v_fingerprint"]
        site["bits_k"] = site["bits_v"] = 16
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata={"lrkv_plan": json.dumps(meta)})
    with pytest.warns(lrkv.LrkvWarning, match="no checksum"):
        loaded = lrkv.RankPlan.load(tmp_path / "v1.safetensors")
    assert loaded.schema_version == 2 and loaded.sites[0].k_layout == lrkv.Layout(bits=16)
    assert loaded.sites[0].rank_k == plan.sites[0].rank_k and torch.equal(loaded.sites[1].up_v, plan.sites[1].up_v)


def test_beam_search_through_a_quantized_cache_equals_the_reference():
    """Beam reordering moves scales and zero points with their codes."""
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, bits_k=4, bits_v=3, group=8, progress=False)
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(0, VOCAB, (1, 7))
    settings = dict(max_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=2)
    with torch.no_grad():
        out = lrkv.compile(model, plan).generate(ids, **settings)
        expected = reference.generate(ids, **settings)
    assert torch.equal(out, expected)


def test_a_rank_rounded_to_whole_groups_warns_and_bits_must_be_integers():
    model = build_model(SMALL)
    with pytest.warns(lrkv.LrkvWarning, match="gives rank 16"):
        lrkv.RankPlan.uniform(model, keep=0.25, bits=4, group=16, progress=False)
    with pytest.raises(lrkv.PlanError, match="bits=4.0"):
        lrkv.Layout(bits=4.0)
