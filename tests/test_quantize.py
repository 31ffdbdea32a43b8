"""Quantized latents: packing, quantization error, rotations, byte accounting, plan files of version 1,
and the rewrite contract for quantized plans (compiled = the eager quantized reference)."""
import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

import lrkv_compile as lrkv
from lrkv_compile.lowering.quantize import QUANTIZED_BITS, dequantize, pack_codes, packed_width, quantize, unpack_codes
from lrkv_compile.passes.factorize import ROTATIONS, rotate, rotation
from lrkv_compile.reference import stepwise
from lrkv_compile.trace import cache_keyword
from strategies import TOLERANCE, VOCAB, build_model

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, print_blob=True)
SMALL = dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32, attention_bias=True,
             num_hidden_layers=2, dtype=torch.float32, seed=0)


@SETTINGS
@given(bits=st.sampled_from(QUANTIZED_BITS), rank=st.integers(1, 300), rows=st.integers(1, 5), seed=st.integers(0, 99))
def test_packing_round_trips(bits, rank, rows, seed):
    codes = torch.randint(0, 2 ** bits, (rows, 3, rank), generator=torch.Generator().manual_seed(seed))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, 3, packed_width(rank, bits))
    assert torch.equal(unpack_codes(packed, bits, rank), codes.to(torch.int32))


def test_three_bit_codes_store_each_units_words_in_order_of_their_place_in_a_block():
    """3-bit codes: the plain little-endian stream (code i at bits 3i..3i+2), then per unit of up to four whole
    blocks of 32 codes (three 4-byte words each) the first words of its blocks, their second words, their third;
    the bytes after the last whole block stay at the end. 232 codes: a unit of four blocks, one of three, 3 bytes."""
    rank = 232
    codes = torch.randint(0, 8, (2, rank), generator=torch.Generator().manual_seed(0))
    stream = torch.tensor([list(sum(int(c) << (3 * i) for i, c in enumerate(row)).to_bytes(87, "little"))
                           for row in codes.tolist()], dtype=torch.uint8)
    words = stream[:, :84].reshape(2, 7, 3, 4)                                        # [row, block, word, byte]
    expected = torch.cat((words[:, :4].transpose(1, 2).reshape(2, 48), words[:, 4:].transpose(1, 2).reshape(2, 36),
                          stream[:, 84:]), 1)
    assert torch.equal(pack_codes(codes, 3), expected)


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


@SETTINGS
@given(bits=st.sampled_from(QUANTIZED_BITS), group=st.sampled_from([2, 4, 8]), tokens=st.integers(1, 20),
       rank=st.integers(1, 12), spread=st.floats(1e-3, 1e3), seed=st.integers(0, 99))
def test_per_channel_quantization_error_is_at_most_half_a_step(bits, group, tokens, rank, spread, seed):
    """Scales per latent channel over blocks of `group` tokens (KIVI's keys), a last partial block included:
    each value within half its own channel-and-block step."""
    generator = torch.Generator().manual_seed(seed)
    # channels of very different ranges, as a latent's leading and trailing channels are
    latent = torch.randn(2, tokens, rank, generator=generator) * spread * torch.logspace(0, -3, rank)
    codes, scale, zero = quantize(latent, bits, group, "channel")
    assert codes.shape == (2, tokens, packed_width(rank, bits)) and scale.shape == (2, -(-tokens // group), rank)
    restored = dequantize(codes, scale, zero, bits, group, "channel")
    step = scale.float().repeat_interleave(group, dim=-2)[:, :tokens]
    # half a step, the fp16 rounding of the zero point and of the grid's top end, and for a step below fp16's
    # normal range its absolute rounding (half of 2^-24) times the largest code
    bound = step / 2 + latent.abs().amax(-2, keepdim=True) * 2e-3 + (2 ** bits - 1) * 2.0 ** -25 + 1e-6
    assert (restored - latent).abs().le(bound).all()
    # per token, one scale spans all those channels: the small channels lose far more
    if rank >= 8 and bits <= 4:
        per_token = dequantize(*quantize(latent, bits, rank), bits, rank)
        small = slice(rank // 2, None)
        assert (restored - latent)[..., small].abs().mean() < (per_token - latent)[..., small].abs().mean()


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


def _greedy_oracle(reference, ids, steps):
    """Greedy decoding by full forwards of the eager reference, one per step of a LatentCache."""
    with torch.no_grad(), stepwise(reference):
        for _ in range(steps):
            logits = reference(input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat((ids, logits.argmax(-1, keepdim=True)), dim=1)
    return ids


@pytest.mark.parametrize("bits_k, bits_v, sinks, window", [(4, 3, 0, 0), (8, 2, 1, 2), (16, 4, 0, 3)])
def test_quantized_plan_through_a_latent_cache_equals_the_quantized_reference(bits_k, bits_v, sinks, window):
    model = build_model(SMALL)
    plan = lrkv.calibrate(model, torch.randint(0, VOCAB, (2, 24)), keep=0.5, bits_k=bits_k, bits_v=bits_v, group=8,
                          sinks=sinks, window=window, progress=False)
    assert {(s.k_layout.bits, s.v_layout.bits) for s in plan.sites} == {(bits_k, bits_v)}
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(0, VOCAB, (2, 9))
    lm = lrkv.compile(model, plan)
    with torch.no_grad():
        out = lm.generate(ids, max_new_tokens=8, do_sample=False)
        stepped = lm(input_ids=ids, use_cache=False).logits  # the stock-cache form: every latent fake-quantized
        full = reference(input_ids=ids, use_cache=False).logits
    assert torch.equal(out, _greedy_oracle(reference, ids, 8))
    torch.testing.assert_close(stepped, full, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("prompt, chunk, sinks, window, axis", [
    (5, 1, 0, 0, "token"), (4, 3, 0, 0, "token"), (5, 1, 2, 3, "token"), (4, 3, 1, 2, "token"),
    (5, 1, 0, 4, "channel"), (3, 5, 1, 4, "channel"), (9, 2, 2, 5, "channel")])
def test_each_step_reads_earlier_steps_quantized_and_its_own_tokens_exact(prompt, chunk, sinks, window, axis):
    """Prefill and decode (one token, or a chunk of several) through a quantized LatentCache = a full forward
    of the reference that quantizes the positions written by earlier steps only, except the sinks and the
    most recent `window` positions, which the cache also holds exact. Per channel (K only, blocks of 4
    tokens), a block is quantized when it fills, whatever step fills it, and read exact until then."""
    model = build_model(SMALL)
    group = 4 if axis == "channel" else 8
    plan = lrkv.RankPlan.uniform(model, keep=0.5, bits_k=3, bits_v=2, group=group, sinks=sinks, window=window,
                                 axis_k=axis, progress=False)
    assert {site.k_layout.axis for site in plan.sites} == {axis}
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(0, VOCAB, (2, prompt + 3 * chunk))
    cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=ids.shape[1])
    lm = lrkv.compile(model, plan)
    starts = [0, *range(prompt, ids.shape[1], chunk)]
    with torch.no_grad(), stepwise(reference):
        for start, end in zip(starts, starts[1:] + [ids.shape[1]]):
            got = lm(input_ids=ids[:, start:end], **{cache_keyword(model): cache}, use_cache=True).logits
            expected = reference(input_ids=ids[:, :end], use_cache=False).logits[:, start:]
            torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    # and the cached positions really are read back quantized: further from the 16-bit numbers than the tolerance
    with torch.no_grad():
        exact = lrkv.low_rank_reference(model, dataclasses.replace(plan, sites=tuple(
            dataclasses.replace(site, k_layout=lrkv.Layout(), v_layout=lrkv.Layout()) for site in plan.sites)))
        assert (exact(input_ids=ids, use_cache=False).logits[:, -1] - got[:, -1]).abs().max() > 2 * TOLERANCE[
            torch.float32]["atol"]


def test_beam_reordering_moves_scales_and_zero_points_with_their_codes():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, bits_k=4, bits_v=3, group=8, sinks=1, window=2, progress=False)
    cache = lrkv.LatentCache(model, plan, max_batch_size=3, max_cache_len=6)
    layer = cache.layers[1]
    for tensor in layer.tensors() + [cache.positions]:
        tensor.copy_(torch.randint(0, 200, tensor.shape).to(tensor.dtype))
    before = [tensor.clone() for tensor in layer.tensors() + [cache.positions]]
    for each in cache.layers:
        each.cumulative_length.fill_(4)
    order = torch.tensor([2, 0, 0])
    cache.reorder_cache(order)
    assert len(before) == 9 and all(tensor.numel() for tensor in before)
    for old, new in zip(before, layer.tensors() + [cache.positions]):
        assert torch.equal(new, old[order])
    assert all(each.positions is cache.positions for each in cache.layers)  # reordered once, still shared


def test_head_wise_codes_are_stored_by_kv_head_and_decode_as_rows_do(monkeypatch):
    """A quantized side of head-wise factors is stored head-major (`quantize.by_blocks`): each KV head's codes,
    scales and zero points of every slot in one run, handed to the ops as the view [batch, slots, KV heads, per
    head]. Where a head's codes do not fill whole bytes (3 bits of 8 channels) the side stays rows. Decoding reads
    the same numbers either way: the same tokens and logits as a cache of rows only."""
    from lrkv_compile import cache as cache_module

    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, bits_k=4, bits_v=3, group=8, sinks=1, window=2, scheme="head",
                                 progress=False)
    ids = torch.randint(0, VOCAB, (2, 7))

    def generate():
        cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=16)
        with torch.no_grad():
            out = lrkv.compile(model, plan).generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache,
                                                     output_scores=True, return_dict_in_generate=True)
        return cache, out

    cache, out = generate()
    layer = cache.layers[0]
    slots, heads = 16, SMALL["num_key_value_heads"]
    assert layer.keys.shape == (2, slots, heads, 4) and layer.keys.stride() == (heads * slots * 4, 4, slots * 4, 1)
    assert layer.k_scale.shape == (2, slots, heads, 1) and layer.k_scale.stride()[1:3] == (1, slots)
    assert layer.values.dim() == 3  # 3-bit codes of 8 channels a head span the bytes of two heads
    monkeypatch.setattr(cache_module, "stored_blocks", lambda *_: 1)
    rows, expected = generate()
    assert rows.layers[0].keys.dim() == 3
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.scores, expected.scores):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_rank_rounded_to_whole_groups_warns_and_bits_must_be_integers():
    model = build_model(SMALL)
    with pytest.warns(lrkv.LrkvWarning, match="gives rank 16"):
        lrkv.RankPlan.uniform(model, keep=0.25, bits=4, group=16, progress=False)
    full = SMALL["num_key_value_heads"] * SMALL["head_dim"]
    with pytest.raises(lrkv.PlanError, match=f"group={2 * full} on K .* has only {full} K channels"):  # (fuzzer)
        lrkv.RankPlan.uniform(model, keep=0.25, bits=4, group=2 * full, scheme="joint", progress=False)
    with pytest.raises(lrkv.PlanError, match="bits=4.0"):
        lrkv.Layout(bits=4.0)


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_plan_files_of_earlier_versions_load(tmp_path, version):
    """Version 1 (no layouts: 16-bit latents), version 2 (RoPE groups, no context), version 3 (no scale
    axis) and version 4 (no rope_window) files, written as those releases wrote them, load as version 5 plans with
    the same sites and factors, and exact RoPE."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from lrkv_compile.plan import tensor_checksum
    # a version-2 quantized side had no sinks: it must load with none, not today's default
    options = dict(bits_k=16, bits_v=4, group=8, sinks={2: 0, 3: 2, 4: 2}[version]) if version > 1 else {}
    plan = lrkv.RankPlan.uniform(build_model(SMALL), keep=0.5, progress=False, **options)
    plan.save(tmp_path / "v5.safetensors")
    with safe_open(str(tmp_path / "v5.safetensors"), framework="pt") as handle:
        meta = json.loads(handle.metadata()["lrkv_plan"])
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    del meta["checksum"], meta["rope_window"]
    if version < 4:
        for site in meta["sites"]:
            for side in ("k_layout", "v_layout"):  # version 3 layouts had no scale axis
                del site[side]["axis"]
    if version >= 3:
        meta["schema_version"] = version
        meta["checksum"] = tensor_checksum(tensors, meta)
        save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"lrkv_plan": json.dumps(meta)})
        loaded = lrkv.RankPlan.load(tmp_path / "old.safetensors")
        assert loaded.schema_version == 5 and loaded.sites == plan.sites and loaded.rope_window == 0
        return
    del meta["context"]
    for site in meta["sites"]:
        site["rope_group"] = 0
        for side in ("k_layout", "v_layout"):  # version 2 layouts had no sinks or window
            del site[side]["sinks"], site[side]["window"]
        if version == 1:
            del site["rope_group"], site["k_layout"], site["v_layout"]
            site["bits_k"] = site["bits_v"] = 16
    meta["schema_version"] = version
    meta["checksum"] = tensor_checksum(tensors, meta)
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"lrkv_plan": json.dumps(meta)})
    loaded = lrkv.RankPlan.load(tmp_path / "old.safetensors")
    assert loaded.schema_version == 5 and loaded.sites == plan.sites and loaded.context == 4096
    assert loaded.rope_window == 0
    for old, new in zip(plan.sites, loaded.sites):
        assert torch.equal(old.down_k, new.down_k) and torch.equal(old.up_v, new.up_v)


def test_exact_tokens_are_for_quantized_sides_and_context_is_checked():
    with pytest.raises(lrkv.PlanError, match="16-bit latents are all stored exactly"):
        lrkv.Layout(bits=16, sinks=4)
    with pytest.raises(lrkv.PlanError, match="window=-1"):
        lrkv.Layout(bits=4, window=-1)
    with pytest.raises(lrkv.PlanError, match="needs window >= 32"):
        lrkv.Layout(bits=4, group=32, axis="channel", window=16)
    with pytest.raises(lrkv.PlanError, match="quantized latents only"):
        lrkv.Layout(bits=16, axis="channel")
    with pytest.raises(lrkv.PlanError, match="axis='rows'"):
        lrkv.Layout(bits=4, axis="rows")
    model = build_model(SMALL)
    with pytest.raises(lrkv.PlanError, match="context=0"):
        lrkv.RankPlan.uniform(model, keep=0.5, context=0, progress=False)
    with pytest.raises(lrkv.PlanError, match="sinks=1.5"):
        lrkv.RankPlan.uniform(model, keep=0.5, bits=4, group=8, sinks=1.5, progress=False)


@SETTINGS
@given(bits=st.sampled_from(QUANTIZED_BITS), outliers=st.integers(1, 6), rest=st.integers(1, 3),
       axis=st.sampled_from(["token", "channel"]), seed=st.integers(0, 99))
def test_outlier_channels_are_stored_in_float16_ahead_of_the_codes(bits, outliers, rest, axis, seed):
    latent = torch.randn(2, 5, outliers + 4 * rest, generator=torch.Generator().manual_seed(seed))
    latent[..., :outliers] *= 100  # the leading singular directions: far larger than the rest
    codes, scale, zero = quantize(latent, bits, 4, axis, outliers)
    assert codes.shape[-1] == 2 * outliers + packed_width(4 * rest, bits)
    restored = dequantize(codes, scale, zero, bits, 4, axis, outliers)
    torch.testing.assert_close(restored[..., :outliers], latent[..., :outliers].half().float(), atol=0, rtol=0)
    # the rest quantized on its own range, not the outliers'
    torch.testing.assert_close(restored[..., outliers:], dequantize(*quantize(latent[..., outliers:], bits, 4, axis),
                                                                     bits, 4, axis), atol=0, rtol=0)


@pytest.mark.parametrize("axis_k", ["token", "channel"])
def test_outlier_channels_through_a_latent_cache_equal_the_reference(axis_k):
    """A plan keeping 8 leading K channels and 4 leading V channels in float16 (the rest rotated and quantized):
    stepwise through a LatentCache = the eager reference; the leading channels are not rotated."""
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.75, bits_k=2, bits_v=3, group=4, outliers_k=8, outliers_v=4,
                                 axis_k=axis_k, window=4, progress=False)
    plain = lrkv.RankPlan.uniform(model, keep=0.75, rotation="none", progress=False)
    for site, unrotated in zip(plan.sites, plain.sites):
        torch.testing.assert_close(site.down_k[:, :8], unrotated.down_k[:, :8])
        assert site.k_layout.outliers == 8 and site.v_layout.outliers == 4
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(0, VOCAB, (2, 11))
    cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=11)
    lm = lrkv.compile(model, plan)
    with torch.no_grad(), stepwise(reference):
        for start, end in ((0, 5), (5, 6), (6, 9), (9, 11)):
            got = lm(input_ids=ids[:, start:end], **{cache_keyword(model): cache}, use_cache=True).logits
            expected = reference(input_ids=ids[:, :end], use_cache=False).logits[:, start:]
            torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    with pytest.raises(lrkv.PlanError, match="needs a joint-scheme side"):
        lrkv.RankPlan.uniform(model, keep=0.75, bits=4, group=4, outliers_k=4, scheme="head", progress=False)
