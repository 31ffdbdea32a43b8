"""Gemma 3 270M (from its wheel), the second real architecture: q/k norms before RoPE, 15 sliding-window layers
(window 512) and 3 global ones, 4 query heads over 1 KV head of 256, on real text held out from calibration."""
import pytest
import torch
from transformers import DynamicCache

import lrkv_compile as lrkv
from lrkv_compile.evaluate import cached_perplexity
from lrkv_compile.models import calibration_and_evaluation_ids, load_gemma3, rows_of


@pytest.fixture(scope="module")
def gemma3():
    model, tokenizer = load_gemma3()
    _, evaluation_ids = calibration_and_evaluation_ids(tokenizer)
    return model, rows_of(evaluation_ids, 1, 1024, "evaluation")


def test_a_full_rank_plan_through_a_latent_cache_reproduces_gemma3_perplexity(gemma3):
    """Prefill 640 tokens, then score the next 384 through the cache: every sliding-window layer reads its ring
    (512 slots) past its wrap, the global layers read all 1024 slots."""
    model, rows = gemma3
    original = cached_perplexity(model, rows, 640, lambda length: DynamicCache(config=model.config), progress=False)
    plan = lrkv.RankPlan.uniform(model, keep=1.0, progress=False)
    assert len(plan.sites) == 18
    caches = []

    def latent_cache(length):
        caches.append(lrkv.LatentCache(model, plan, max_batch_size=1, max_cache_len=length))
        return caches[-1]
    got = cached_perplexity(lrkv.compile(model, plan), rows, 640, latent_cache, progress=False)
    print(f"Gemma 3 270M, 1024 tokens, continuation after 640: original {original:.4f}, lrkv full rank {got:.4f}")
    assert got == pytest.approx(original, rel=1e-4)
    windows = [layer.keys.shape[1] for layer in caches[0].layers]
    assert windows.count(512) == 15 and windows.count(1024) == 3
    # full rank, 16-bit: the rings alone hold (15 x 512 + 3 x 1024) / (18 x 1024) of a full cache's slots
    assert caches[0].nbytes() / caches[0].full_cache_nbytes() == pytest.approx((15 * 512 + 3 * 1024) / (18 * 1024),
                                                                               abs=0.01)
