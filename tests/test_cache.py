"""LatentCache: memory accounting and its errors."""
import pytest
import torch

import lrkv_compile as lrkv
from strategies import VOCAB, build_model

SMALL = dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32, attention_bias=False,
             num_hidden_layers=2, dtype=torch.float32, seed=0)


def test_nbytes_counts_latents_and_one_rope_table():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    cache = lrkv.LatentCache(model, plan, max_batch_size=3, max_cache_len=10)
    latents = 2 * 3 * 10 * (16 + 16) * 4
    rope = 2 * 3 * 10 * 16 * 4
    assert cache.nbytes() == latents + rope
    assert cache.full_cache_nbytes() == 2 * 3 * 10 * (2 * 32) * 4


def test_latent_cache_without_the_backend_raises():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    cache = lrkv.LatentCache(model, plan, max_cache_len=16)
    with pytest.raises(lrkv.UnrewrittenSiteError, match="backend='lrkv'"), torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), past_key_values=cache, use_cache=True)


def test_context_longer_than_the_cache_raises():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
    cache = lrkv.LatentCache(model, plan, max_cache_len=8)
    with pytest.raises(lrkv.CacheOverflowError, match="max_cache_len=8"), torch.no_grad():
        model.generate(torch.randint(0, VOCAB, (1, 6)), past_key_values=cache, max_new_tokens=5, do_sample=False)


def test_cache_of_another_plan_is_rejected():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    other = lrkv.RankPlan.uniform(model, keep=0.25, progress=False)
    model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
    cache = lrkv.LatentCache(model, other, max_cache_len=16)
    with pytest.raises(Exception, match="same plan"), torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), past_key_values=cache, use_cache=True)
