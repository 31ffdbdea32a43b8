"""LatentCache: memory accounting and its errors."""
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import lrkv_compile as lrkv
from strategies import VOCAB, build_model

SMALL = dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32, attention_bias=False,
             num_hidden_layers=2, dtype=torch.float32, seed=0)


def test_nbytes_counts_latents_exact_tokens_and_positions():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    cache = lrkv.LatentCache(model, plan, max_batch_size=3, max_cache_len=10)
    latents = 2 * 3 * 10 * (16 + 16) * 4  # two layers, float32 latents of rank 16 per side
    positions = 3 * 10 * 4                 # one int32 per slot and row, for all layers
    assert cache.nbytes() == latents + positions
    assert cache.full_cache_nbytes() == 2 * 3 * 10 * (2 * 32) * 4
    quantized = lrkv.RankPlan.uniform(model, keep=0.5, bits=4, group=8, sinks=2, window=3, progress=False)
    cache = lrkv.LatentCache(model, quantized, max_batch_size=3, max_cache_len=10)
    codes = 16 * 4 // 8 + 2 * 2 * 16 // 8  # packed codes, then an fp16 scale and zero per group of 8
    exact = 2 * 3 * 5 * 2 * 16 * 2         # two layers and sides, 2 sinks + 3 window tokens in fp16
    assert cache.nbytes() == 2 * 2 * 3 * 10 * codes + exact + positions
    assert cache.nbytes() == pytest.approx(quantized.budget_at(10) * cache.full_cache_nbytes(torch.float16))
    # keys per channel over blocks of 4 tokens: 3 blocks of 10 slots, one fp16 scale and zero per channel each;
    # the window is raised to the block (4)
    per_channel = lrkv.RankPlan.uniform(model, keep=0.5, bits=4, group=4, sinks=2, window=3, axis_k="channel",
                                        progress=False)
    assert {(s.k_layout.window, s.v_layout.window) for s in per_channel.sites} == {(4, 3)}
    cache = lrkv.LatentCache(model, per_channel, max_batch_size=3, max_cache_len=10)
    keys = 3 * 10 * 16 * 4 // 8 + 3 * 3 * 16 * 2 * 2 + 3 * 6 * 16 * 2
    values = 3 * 10 * (16 * 4 // 8 + 2 * 2 * 16 // 4) + 3 * 5 * 16 * 2
    assert cache.nbytes() == 2 * (keys + values) + positions
    assert cache.nbytes() == pytest.approx(per_channel.budget_at(10) * cache.full_cache_nbytes(torch.float16))


def test_latent_cache_without_the_backend_raises():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    cache = lrkv.LatentCache(model, plan, max_cache_len=16)
    with pytest.raises(lrkv.UnrewrittenSiteError, match="backend='lrkv'"), torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), **{lrkv.cache_keyword(model): cache}, use_cache=True)


def test_context_longer_than_the_cache_raises():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
    cache = lrkv.LatentCache(model, plan, max_cache_len=8)
    with pytest.raises(lrkv.CacheOverflowError, match="max_cache_len=8"), torch.no_grad():
        model.generate(torch.randint(0, VOCAB, (1, 6)), **{lrkv.cache_keyword(model): cache}, max_new_tokens=5,
                       do_sample=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the context check on the GPU is a device assertion; "
                    "on CPU the same check raises CacheOverflowError (the test above)")
def test_context_longer_than_the_cache_stops_the_gpu():
    """On the GPU the write checks the context on the device (no host read of the length): a device assertion,
    which leaves the CUDA context unusable, so the step runs in a process of its own."""
    # SMALL as its repr, which names its dtype as torch does
    script = textwrap.dedent(f"""
        import torch
        import lrkv_compile as lrkv
        from strategies import VOCAB, build_model
        model = build_model({SMALL!r}).cuda()
        plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
        model.forward = torch.compile(model.forward, backend="lrkv", options={{"plan": plan}})
        cache = lrkv.LatentCache(model, plan, max_cache_len=8)
        with torch.no_grad():
            model.generate(torch.randint(0, VOCAB, (1, 6), device="cuda"), **{{lrkv.cache_keyword(model): cache}},
                           max_new_tokens=5, do_sample=False)
        torch.cuda.synchronize()
        print("no error")
    """)
    tests = Path(__file__).parent
    result = subprocess.run([sys.executable, "-c", script], cwd=tests, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "no error" not in result.stdout, result.stdout[-2000:]
    assert "device-side assert" in result.stderr or "CacheOverflowError" in result.stderr, result.stderr[-3000:]


def test_cache_of_another_plan_is_rejected():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    other = lrkv.RankPlan.uniform(model, keep=0.25, progress=False)
    model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
    cache = lrkv.LatentCache(model, other, max_cache_len=16)
    with pytest.raises(Exception, match="same plan"), torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), **{lrkv.cache_keyword(model): cache}, use_cache=True)


TOKEN = dict(bits=4, group=8, sinks=2, window=3)
CHANNEL = dict(bits=4, group=4, sinks=2, window=4, axis_k="channel")


@pytest.mark.parametrize("layout, tokens", [(dict(), 1), (dict(), 5), (TOKEN, 1), (TOKEN, 5), (CHANNEL, 1)],
                         ids=["16-bit-1", "16-bit-5", "4-bit-1", "4-bit-5", "4-bit-per-channel-keys-1"])
def test_the_write_never_reads_the_device(layout, tokens):
    """16-bit and per-token latents, and a decode step's per-channel keys, are written with tensor indices only: on
    meta tensors, which have no values, any host read (int(length), a boolean mask's nonzero) would raise. This is
    what lets CUDA graphs capture a decode step's writes."""
    from lrkv_compile.lowering import reference
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False, **layout)
    cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=16, device="meta")
    layer, site = cache.layers[0], plan.sites[0]
    sides = {side: dict(bits=getattr(site, f"{side}_layout").bits, group=getattr(site, f"{side}_layout").group,
                        sinks=getattr(site, f"{side}_layout").sinks, axis=getattr(site, f"{side}_layout").axis,
                        outliers=getattr(site, f"{side}_layout").outliers) for side in "kv"}
    reference.latent_write(
        *layer.tensors(), positions=layer.positions, new_k=torch.zeros(2, tokens, site.rank_k, device="meta"),
        new_v=torch.zeros(2, tokens, site.rank_v, device="meta"),
        new_positions=torch.zeros(1, tokens, dtype=torch.long, device="meta"), length=layer.cumulative_length,
        **{f"{side}_{name}": value for side, fields in sides.items() for name, value in fields.items()})


def test_the_cache_goes_by_the_name_the_installed_transformers_takes():
    """transformers 5.24 renamed the forward's and generate()'s `past_key_values` to `cache` (the old name warns
    until 5.40): lrkv passes the name the installed version takes, so its paths raise no deprecation warning."""
    from packaging.version import Version
    from transformers import DynamicCache, __version__
    from lrkv_compile.evaluate import cached_perplexity
    model = build_model(SMALL)
    expected = "cache" if Version(__version__) >= Version("5.24") else "past_key_values"
    assert lrkv.cache_keyword(model) == expected
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    ids = torch.randint(0, VOCAB, (1, 6))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values")
        lm = lrkv.compile(model, plan)  # its check traces the model through a LatentCache
        lm.generate(ids, max_new_tokens=3, do_sample=False)
        cached_perplexity(model, ids, 3, lambda length: DynamicCache(config=model.config), progress=False)
        cached_perplexity(lm, ids, 3, lambda length: lrkv.LatentCache(model, plan, max_cache_len=length),
                          progress=False)
        if expected == "cache":  # the old name would have failed the test
            with pytest.raises(FutureWarning, match="past_key_values"), torch.no_grad():
                model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
