"""Windowed RoPE (`RankPlan.rope_window`, A2ATS): what a windowed plan computes, on the reference ops, against the
formula written out on the model's own keys; how plans carry and refuse it."""
import dataclasses

import numpy
import pytest
import torch
from transformers import AttentionInterface, DynamicCache, GPTNeoXConfig, GPTNeoXForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

import lrkv_compile as lrkv
from lrkv_compile.trace import cache_keyword
from strategies import VOCAB, build_model

SPEC = dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=64, attention_bias=False,
            num_hidden_layers=2, dtype=torch.float32, seed=3)
WINDOW = 3


def _turn(x, positions, inv_freq):
    """Rotate-half RoPE of x [..., tokens, head_dim] at integer positions [tokens]: its first 2 len(inv_freq) channels
    (all of them, or partial rotary)."""
    angles = positions.double()[:, None] * inv_freq.double()[None]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    rotary = cos.shape[-1]
    turned, passed = x[..., :rotary].double(), x[..., rotary:]
    half = rotary // 2
    turned = turned * cos + torch.cat((-turned[..., half:], turned[..., :half]), -1) * sin
    return torch.cat((turned.to(x.dtype), passed), -1)


def windowed_attention(module, query, key, value, attention_mask, scaling=None, **_):
    """The windowed-RoPE scores written out from the model's RoPE-turned queries and keys (positions 0, 1, ...):
    a key WINDOW or more behind its query scores as <R(WINDOW) q, k> with q, k as they were before RoPE."""
    inv_freq = module.lrkv_inv_freq
    batch, heads, tokens, head_dim = query.shape
    slots = key.shape[2]
    group = heads // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    query_at, key_at = torch.arange(slots - tokens, slots), torch.arange(slots)
    plain_query, plain_key = _turn(query, -query_at, inv_freq), _turn(key, -key_at, inv_freq)
    near = query @ key.transpose(-1, -2)
    far = _turn(plain_query, torch.full((tokens,), WINDOW), inv_freq) @ plain_key.transpose(-1, -2)
    behind = query_at[:, None] - key_at[None, :]
    scores = torch.where(behind >= WINDOW, far, near) * scaling
    scores = scores.masked_fill(behind < 0, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register("lrkv_test_windowed", windowed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("lrkv_test_windowed", sdpa_mask)


def _steps(forward, cache, ids, steps):
    """Logits of the prompt `ids` prefilled into `cache` ({keyword: cache}), then of `steps` greedy one-token steps,
    concatenated."""
    with torch.no_grad():
        logits = [forward(input_ids=ids, **cache, use_cache=True).logits]
        for _ in range(steps):
            token = logits[-1][:, -1:].argmax(-1)
            logits.append(forward(input_ids=token, **cache, use_cache=True).logits)
    return torch.cat(logits, 1)


def _neox():
    """A GPT-NeoX model with partial rotary: RoPE turns half of each head's 16 channels."""
    torch.manual_seed(1)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, rotary_pct=0.5, max_position_embeddings=64,
                           initializer_range=0.1)  # sharper attention than the default, so the window shows
    config._attn_implementation = "sdpa"
    return GPTNeoXForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["llama", "gpt_neox (partial rotary)"])
def test_a_windowed_full_rank_plan_computes_windowed_rope_on_the_model(family):
    """Full rank (the factors reproduce K and V): the compiled model's prefill and decode steps equal the model with
    its attention replaced by windowed RoPE written out, and differ from exact RoPE."""
    model = build_model(SPEC) if family == "llama" else _neox()
    plan = dataclasses.replace(lrkv.RankPlan.uniform(model, keep=1.0, progress=False), rope_window=WINDOW)
    ids = torch.randint(0, VOCAB, (2, 7))
    lm, keyword = lrkv.compile(model, plan), cache_keyword(model)
    actual = _steps(lm, {keyword: lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=16)}, ids, 5)
    exact = _steps(model, {keyword: DynamicCache(config=model.config)}, ids, 5)
    inner = model.model if family == "llama" else model.gpt_neox
    for layer in inner.layers:
        attention = layer.self_attn if family == "llama" else layer.attention
        attention.lrkv_inv_freq = inner.rotary_emb.inv_freq
    model.config._attn_implementation = "lrkv_test_windowed"
    expected = _steps(model, {keyword: DynamicCache(config=model.config)}, ids, 5)
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=2e-4)
    assert (actual - exact).abs().max() > 10 * 2e-4  # the window changes what is computed, beyond the tolerance


def test_a_plan_keeps_its_rope_window_through_a_file(tmp_path):
    model = build_model(SPEC)
    plan = dataclasses.replace(lrkv.RankPlan.uniform(model, keep=0.5, progress=False), rope_window=numpy.int64(512))
    plan.save(tmp_path / "plan.safetensors")
    loaded = lrkv.RankPlan.load(tmp_path / "plan.safetensors")
    assert loaded.rope_window == 512 and "windowed RoPE beyond 512 tokens" in loaded.summary()


@pytest.mark.parametrize("window", [-1, 2.5, True, "64"])
def test_a_rope_window_that_is_not_a_count_of_tokens_is_a_plan_error(window):
    model = build_model(SPEC)
    with pytest.raises(lrkv.PlanError, match="rope_window"):
        lrkv.RankPlan.uniform(model, keep=0.5, progress=False, rope_window=window)


def test_a_windowed_plan_without_a_latent_cache_is_refused():
    """A stock cache keeps the model's own attention, which cannot compute windowed RoPE: an error saying what to
    pass, never exact RoPE in silence."""
    model = build_model(SPEC)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False, rope_window=WINDOW)
    with pytest.raises(lrkv.PlanMismatchError, match="LatentCache"), torch.no_grad():
        lrkv.compile(model, plan)(input_ids=torch.randint(0, VOCAB, (1, 5)), use_cache=False)
    with pytest.raises(lrkv.PlanMismatchError, match="exact RoPE"):
        lrkv.low_rank_reference(model, plan)
