"""Sliding-window layers keep a latent ring of window size: bytes that do not grow with the context, and the
eager low-rank reference's logits at every step, prompts and continuation chunks longer than the window."""
import pytest
import torch

import lrkv_compile as lrkv
from lrkv_compile import zoo
from lrkv_compile.reference import stepwise
from lrkv_compile.trace import cache_keyword
from strategies import TOLERANCE

WINDOW = 5
PLANS = {
    "16-bit": dict(keep=0.5),
    "token-axis 4/3-bit, sinks": dict(keep_k=0.5, keep_v=1.0, bits_k=4, bits_v=3, group=8, sinks=2),
    "channel-axis keys, exact window": dict(keep=1.0, bits=4, group=4, sinks=1, window=4, axis_k="channel"),
}


@pytest.mark.parametrize("family, plan_name", [("mistral", name) for name in PLANS]
                         + [("gemma3", "channel-axis keys, exact window")])
def test_a_sliding_window_layer_holds_a_ring_and_decodes_as_the_reference(family, plan_name):
    model = zoo.build(family, layers=3, sliding_window=WINDOW)
    plan = lrkv.RankPlan.uniform(model, progress=False, **PLANS[plan_name])
    cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=32)
    windows = [WINDOW] * 3 if family == "mistral" else [WINDOW, None, WINDOW]  # Gemma 3: sliding, global, sliding
    channel_group = 4 if "channel" in plan_name else 1
    expected_slots = [-(-WINDOW // channel_group) * channel_group if window else 32 for window in windows]
    assert [layer.keys.shape[1] for layer in cache.layers] == expected_slots
    longer = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=64)
    for index, window in enumerate(windows):  # a ring's bytes do not grow with the context
        held = [sum(t.numel() * t.element_size() for t in c.layers[index].tensors()) for c in (cache, longer)]
        assert held[0] == held[1] if window else held[0] < held[1]
    reference = lrkv.low_rank_reference(model, plan)
    compiled = lrkv.compile(model, plan)
    ids = torch.randint(3, zoo.VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), stepwise(reference):
        # a prompt longer than the window, decode steps, and continuation chunks longer than the window
        for start, end in ((0, 7), (7, 8), (8, 9), (9, 15), (15, 16), (16, 24)):
            positions = torch.arange(start, end)[None].expand(2, -1)
            got = compiled(input_ids=ids[:, start:end], position_ids=positions, **{cache_keyword(model): cache},
                           use_cache=True).logits
            expected = reference(input_ids=ids[:, :end], use_cache=False).logits[:, start:]
            torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
