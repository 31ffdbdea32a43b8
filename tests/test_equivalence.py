"""The rewrite contract, over random small configurations (hypothesis):
full rank = the original model; truncated plan = the eager low-rank reference;
prefill + decode steps through a LatentCache = one full forward of that reference."""
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import lrkv_compile as lrkv
from lrkv_compile.trace import cache_keyword
from strategies import TOLERANCE, VOCAB, build_model, model_configs

SETTINGS = settings(max_examples=6, deadline=None, derandomize=True, print_blob=True)


def compiled(model, plan):
    torch._dynamo.reset()
    return torch.compile(model.forward, backend="lrkv", options={"plan": plan})


def logits(forward, ids):
    with torch.no_grad():
        return forward(input_ids=ids, use_cache=False).logits.float()


@SETTINGS
@given(spec=model_configs(), batch=st.integers(1, 2), tokens=st.integers(2, 12))
def test_full_rank_plan_equals_original(spec, batch, tokens):
    model = build_model(spec)
    plan = lrkv.RankPlan.uniform(model, keep=1.0, progress=False)
    ids = torch.randint(0, VOCAB, (batch, tokens))
    torch.testing.assert_close(logits(compiled(model, plan), ids), logits(model.forward, ids),
                               **TOLERANCE[spec["dtype"]])


@SETTINGS
@given(spec=model_configs(), keep=st.sampled_from([0.25, 0.5, 0.75]), scheme=st.sampled_from(["joint", "head", "hybrid"]),
       tokens=st.integers(2, 12))
def test_truncated_plan_equals_low_rank_reference(spec, keep, scheme, tokens):
    model = build_model(spec)
    plan = lrkv.RankPlan.uniform(model, keep=keep, scheme=scheme, progress=False)
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(0, VOCAB, (1, tokens))
    torch.testing.assert_close(logits(compiled(model, plan), ids), logits(reference.forward, ids),
                               **TOLERANCE[spec["dtype"]])


@SETTINGS
@given(spec=model_configs(), keep=st.sampled_from([0.5, 1.0]), batch=st.integers(1, 2),
       prompt=st.integers(1, 8), steps=st.integers(1, 4), value_path=st.sampled_from(["auto", "absorb", "up"]))
def test_latent_cache_decode_equals_full_forward(spec, keep, batch, prompt, steps, value_path):
    model = build_model(spec)
    plan = lrkv.RankPlan.uniform(model, keep=keep, progress=False)
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(0, VOCAB, (batch, prompt + steps))
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan, "value_path": value_path})
    cache = lrkv.LatentCache(model, plan, max_batch_size=batch, max_cache_len=prompt + steps + 3)
    outputs = []
    with torch.no_grad():
        outputs.append(forward(input_ids=ids[:, :prompt], **{cache_keyword(model): cache}, use_cache=True).logits)
        for step in range(prompt, prompt + steps):
            outputs.append(forward(input_ids=ids[:, step:step + 1], **{cache_keyword(model): cache},
                                   use_cache=True).logits)
    stepped = torch.cat(outputs, dim=1).float()
    torch.testing.assert_close(stepped, logits(reference.forward, ids), **TOLERANCE[spec["dtype"]])
    assert int(cache.get_seq_length()) == prompt + steps



@SETTINGS
@given(pairs=st.integers(1, 8), passed=st.sampled_from([0, 2, 8]), tokens=st.integers(1, 6), seed=st.integers(0, 99))
def test_interleaved_rope_is_rotate_half_rope_in_rotate_half_order(pairs, passed, tokens, seed):
    """rewrite.rotate_half_order: RoPE_interleaved(x)[order] = RoPE_rotate_half(x[order]), GPT-J's RoPE (its own
    code and sin/cos table) against the reference op's (rotate-half, cos/sin read from that table)."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions
    from lrkv_compile.lowering import reference
    from lrkv_compile.passes.rewrite import rotate_half_order
    generator = torch.Generator().manual_seed(seed)
    rotary_dim, head_dim = 2 * pairs, 2 * pairs + passed
    keys = torch.randn(2, tokens, 3, head_dim, generator=generator)  # [batch, tokens, heads, head_dim]
    table = create_sinusoidal_positions(64, rotary_dim)  # [positions, sin | cos]
    positions = torch.randint(0, 64, (2, tokens), generator=generator)
    sin, cos = table[positions].split(pairs, dim=-1)
    interleaved = torch.cat((apply_rotary_pos_emb(keys[..., :rotary_dim], sin, cos), keys[..., rotary_dim:]), -1)
    order = rotate_half_order(head_dim, rotary_dim)
    cos, sin = reference.rope_tables(positions, None, 1.0, keys.dtype, table[:, pairs:], table[:, :pairs])
    turned, kept = keys[..., order][..., :rotary_dim], keys[..., order][..., rotary_dim:]
    rotate_half = turned * cos[:, :, None] + reference.rotate_half(turned) * sin[:, :, None]
    torch.testing.assert_close(torch.cat((rotate_half, kept), -1), interleaved[..., order], **TOLERANCE[torch.float32])

def test_stock_cache_is_correct_and_warns():
    model = build_model(dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32,
                             attention_bias=False, num_hidden_layers=2, dtype=torch.float32, seed=1))
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(0, VOCAB, (1, 6))
    lrkv.backend._warned_stock_cache = False
    model.forward = compiled(model, plan)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert any("NOT reduced" in str(w.message) for w in caught)
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_left_padded_batch(do_sample):
    """batch > 1 with left padding, greedy and sampling, max_new_tokens past the prompt."""
    model = build_model(dict(num_key_value_heads=2, num_attention_heads=6, head_dim=16, hidden_size=48,
                             attention_bias=True, num_hidden_layers=2, dtype=torch.float32, seed=3))
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(1, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=do_sample, pad_token_id=0, top_k=None)
    model.forward = compiled(model, plan)
    cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=21)
    with torch.no_grad():
        torch.manual_seed(0)
        out = model.generate(ids, **{cache_keyword(model): cache}, **kwargs)
        torch.manual_seed(0)
        expected = reference.generate(ids, **kwargs)
    assert out.shape == (2, 21)
    assert torch.equal(out, expected)
