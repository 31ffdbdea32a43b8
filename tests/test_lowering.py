"""The backend's lowering stage: Inductor around the rewritten graph (the default on CUDA; forced here on CPU, or
chosen by an Inductor mode)."""
import dataclasses

import pytest
import torch

import lrkv_compile as lrkv
from lrkv_compile.trace import cache_keyword
from strategies import VOCAB, build_model


def test_inductor_compiles_the_rewritten_graph_and_changes_no_result():
    """inductor=True, or mode="reduce-overhead" (which means Inductor; CUDA graphs themselves need a GPU): the
    factors the rewrite added reach AOTAutograd, the cache writes land in the real buffers (the decode step reads
    what prefill wrote), and prefill and decode logits equal the uncompiled graph's."""
    model = build_model(dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32,
                             attention_bias=False, num_hidden_layers=1, dtype=torch.float32, seed=0))
    plan = lrkv.calibrate(model, torch.randint(0, VOCAB, (2, 24)), keep=0.5, bits=4, group=8, progress=False)
    ids = torch.randint(0, VOCAB, (2, 9))
    results = {}
    for name, options in {"plain": dict(inductor=False), "inductor": dict(inductor=True),
                          "reduce-overhead": dict(mode="reduce-overhead")}.items():
        cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=16)
        lm = lrkv.compile(model, plan, **options)
        with torch.no_grad():
            prefill = lm(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True).logits
            decode = lm(input_ids=prefill[:, -1:].argmax(-1), **{cache_keyword(model): cache}, use_cache=True).logits
        results[name] = (prefill, decode, int(cache.get_seq_length()))
    for name in ("inductor", "reduce-overhead"):
        assert results[name][2] == results["plain"][2] == 10
        torch.testing.assert_close(results[name][0], results["plain"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(results[name][1], results["plain"][1], atol=1e-5, rtol=1e-5)


def test_a_fake_reads_the_arguments_the_op_binds_by_name():
    """A fake names only what it reads (`ops._fake` binds the op's arguments to its one signature): the op traces
    under fake tensors, positional or by keyword, to the shape its implementation returns."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    latent = torch.randn(2, 3, 8, 16)
    torch.library.opcheck(torch.ops.lrkv.fake_quantize, (latent, 4, 8, "token", 0))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(latent)
        out = torch.ops.lrkv.fake_quantize(latent=fake, bits=4, group=8, axis="token", outliers=0)
    assert out.shape == latent.shape and out.dtype == latent.dtype


def _lowered(model, plan, ids, max_cache_len, monkeypatch):
    """(rewritten graph, example inputs) of each graph the backend lowers in lrkv.compile(model, plan)'s first call
    on `ids` with a fresh LatentCache."""
    from lrkv_compile import backend

    seen, lower = [], backend.lower
    monkeypatch.setattr(backend, "lower", lambda gm, inputs, *args: seen.append((gm, inputs)) or lower(gm, inputs,
                                                                                                     *args))
    cache = lrkv.LatentCache(model, plan, max_batch_size=ids.shape[0], max_cache_len=max_cache_len)
    with torch.no_grad():
        lrkv.compile(model, plan)(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True)
    return seen


def test_a_plan_traced_at_another_batch_leaves_the_compiled_step_static(monkeypatch):
    """Making a plan traces the model (here at RankPlan.uniform's own batch); the compiled model's first step, at
    batch 3 with a 24-slot cache, is still compiled for those sizes. Dynamo's automatic dynamic shapes remember the
    sizes a function ran at by its name, so traces run a forward copy named apart from lrkv.compile's (else its
    first graph is symbolic in batch and cache sizes: twice the compile time for a 32-layer model)."""
    model = build_model(dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32,
                             attention_bias=False, num_hidden_layers=2, dtype=torch.float32, seed=0))
    plan = lrkv.RankPlan.uniform(model, keep_k=0.5, keep_v=1.0, bits_k=4, bits_v=3, group=8, progress=False)
    lrkv.explain(model, plan, show=False)  # one more trace, at its own sizes
    [(_, inputs)] = _lowered(model, plan, torch.randint(0, VOCAB, (3, 1)), 24, monkeypatch)
    symbolic = [value for value in inputs if isinstance(value, torch.SymInt)
                or isinstance(value, torch.Tensor) and not all(isinstance(size, int) for size in value.shape)]
    assert not symbolic, f"{len(symbolic)} symbolic inputs: {symbolic[:3]}"


def test_both_sides_latents_come_from_one_product_per_site(monkeypatch):
    """The rewritten graph projects each site's new keys and values to their latents in one linear over [down_k |
    down_v], split into views for the write and the attention (one launch a layer, not two); their values are the
    separate products'."""
    model = build_model(dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32,
                             attention_bias=False, num_hidden_layers=2, dtype=torch.float32, seed=0))
    plan = lrkv.RankPlan.uniform(model, keep_k=0.5, keep_v=1.0, bits_k=4, bits_v=3, group=8, progress=False)
    [(gm, _)] = _lowered(model, plan, torch.randint(0, VOCAB, (2, 3)), 16, monkeypatch)
    downs = [node for node in gm.graph.nodes if node.op == "get_attr" and "_down" in node.target]
    assert sorted(node.target for node in downs) == ["lrkv_site0_down_kv", "lrkv_site1_down_kv"]
    for node, site in zip(sorted(downs, key=lambda node: node.target), plan.sites):
        [product] = node.users
        weight = getattr(gm, node.target)
        torch.testing.assert_close(weight, torch.cat((site.down_k, site.down_v), dim=1).T)
        [split] = product.users
        assert split.target is torch.split and split.args[1] == [site.rank_k, site.rank_v]
        writes = [user for part in split.users for user in part.users
                  if user.target is torch.ops.lrkv.latent_write.default]
        assert len(writes) == 2 and writes[0] is writes[1]


def _writes(gm):
    """The graph's latent ops in order, and its writes among them."""
    ops = [node for node in gm.graph.nodes
           if node.target in (torch.ops.lrkv.latent_write.default, torch.ops.lrkv.latent_attention.default)]
    return ops, [node for node in ops if node.target is torch.ops.lrkv.latent_write.default]


def test_the_first_write_of_a_step_asserts_the_context_on_the_device(monkeypatch):
    """A decode step's graph asserts that the context fits the cache once (`device_check`), at its first write, which
    comes before every attention reads the cache (three layers: one assertion a step where there were three); the
    later writes store nothing past the cache (`test_write_kernel.py`)."""
    model = build_model(dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32,
                             attention_bias=False, num_hidden_layers=3, dtype=torch.float32, seed=0))
    plan = lrkv.RankPlan.uniform(model, keep_k=0.5, keep_v=1.0, bits_k=4, bits_v=3, group=8, progress=False)
    [(gm, _)] = _lowered(model, plan, torch.randint(0, VOCAB, (2, 1)), 16, monkeypatch)
    ops, writes = _writes(gm)
    assert [node.kwargs["device_check"] for node in writes] == [True, False, False] and ops[0] is writes[0]


@pytest.mark.parametrize("family, checks", [("gemma3", [False, True, False]), ("mistral", [True, False, False])])
def test_a_ring_writes_after_its_attention_so_the_first_full_cache_write_asserts(family, checks, monkeypatch):
    """A sliding-window layer's ring is written after its attention, which no later layer waits for: Gemma 3's
    (sliding, global, sliding) asserts at its global layer's write, the one write a full-length cache gets before
    its attention; Mistral's (three rings) at its first write, having no other."""
    from lrkv_compile import zoo

    model = zoo.build(family, layers=3, sliding_window=5)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    [(gm, _)] = _lowered(model, plan, torch.randint(3, zoo.VOCAB, (2, 1)), 32, monkeypatch)
    ops, writes = _writes(gm)
    assert ops[0].target is torch.ops.lrkv.latent_attention.default  # the first layer's ring: attention first
    assert [node.kwargs["device_check"] for node in writes] == checks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU; on CPU the first test runs "
                    "mode='reduce-overhead' through Inductor without them, and test_cache.py writes channel-axis "
                    "blocks on meta tensors (the write reads nothing on the host)")
def test_cuda_graphs_replay_decode_steps_of_a_channel_axis_plan():
    """mode="reduce-overhead" captures and replays decode steps whose write quantizes keys per channel over blocks of
    8 slots (the reference write: the Triton write quantizes per token) while the Triton kernel reads them: 12
    steps from a 5-token prompt cross the blocks' edges, and each step's logits match the uncompiled graph run on
    the reference ops."""
    model = build_model(dict(num_key_value_heads=2, num_attention_heads=8, head_dim=64, hidden_size=128,
                             attention_bias=False, num_hidden_layers=2, dtype=torch.float16, seed=0)).cuda()
    plan = lrkv.RankPlan.uniform(model, keep=0.5, bits=4, group=8, axis_k="channel", progress=False)
    from torch._dynamo.utils import counters

    counters.clear()
    logits = _greedy_steps(model, plan, torch.randint(0, VOCAB, (2, 5), device="cuda"), steps=13, max_cache_len=32)
    assert not counters["inductor"]["cudagraph_skips"], "Inductor ran the steps without CUDA graphs"
    torch.testing.assert_close(logits["cuda graphs"], logits["reference"], atol=2e-2, rtol=2e-2)


def _greedy_steps(model, plan, prompt, steps, max_cache_len):
    """Each step's last logits, {"reference": the uncompiled graph on the reference ops, "cuda graphs":
    mode="reduce-overhead"}, from `prompt` and then the reference's greedy tokens, fed to both."""
    logits, tokens = {}, None
    for name, options in {"reference": dict(inductor=False, kernels="reference"),
                          "cuda graphs": dict(mode="reduce-overhead")}.items():
        cache = lrkv.LatentCache(model, plan, max_batch_size=prompt.shape[0], max_cache_len=max_cache_len)
        lm = lrkv.compile(model, plan, **options)
        outputs, chosen, token = [], [], prompt
        with torch.no_grad():
            for step in range(steps):
                outputs.append(lm(input_ids=token, **{cache_keyword(model): cache},
                                  use_cache=True).logits[:, -1].float().clone())
                token = outputs[-1].argmax(-1, keepdim=True) if tokens is None else tokens[step]
                chosen.append(token)
        logits[name], tokens = torch.stack(outputs), chosen
    return logits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU; on CPU tests/test_kernels.py runs "
                    "the far tiles through tensor descriptors under Triton's interpreter")
def test_cuda_graphs_replay_decode_steps_that_read_far_tiles_through_tensor_descriptors(monkeypatch):
    """mode="reduce-overhead" with a windowed 16-bit plan: the decode kernel reads its far tiles through tensor
    descriptors built on the host at capture (`triton_decode.tile_descriptor`), and replays them as the cache grows
    past a whole far tile (90-token prompts, an 8-token window, 64-slot tiles); each step's logits match the
    uncompiled graph run on the reference ops."""
    model = build_model(dict(num_key_value_heads=2, num_attention_heads=8, head_dim=64, hidden_size=128,
                             attention_bias=False, num_hidden_layers=2, dtype=torch.float16, seed=0)).cuda()
    plan = dataclasses.replace(lrkv.RankPlan.uniform(model, keep=0.5, progress=False), rope_window=8)
    from lrkv_compile.lowering import ahead, triton_decode
    from torch._dynamo.utils import counters

    made, taken = triton_decode.tile_descriptor, []

    def tile_descriptor(*args):  # those of the steps, not of their kernels' compiles ahead (lowering.ahead)
        descriptor = made(*args)
        if not ahead.compiling():
            taken.append(descriptor)
        return descriptor
    monkeypatch.setattr(triton_decode, "tile_descriptor", tile_descriptor)
    counters.clear()
    logits = _greedy_steps(model, plan, torch.randint(0, VOCAB, (2, 90), device="cuda"), steps=8, max_cache_len=128)
    assert not counters["inductor"]["cudagraph_skips"], "Inductor ran the steps without CUDA graphs"
    assert taken, "no far tile went through a tensor descriptor"
    torch.testing.assert_close(logits["cuda graphs"], logits["reference"], atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU; tests/test_prefill_kernel.py runs "
                    "the rebuild path's capture branch on CPU under the interpreter")
def test_cuda_graphs_capture_and_replay_a_long_prefill_on_the_rebuild_path(monkeypatch):
    """mode="reduce-overhead" with 80-token prompts (4-bit latents: the prefill's rebuild path): CUDA graph trees
    warm the prefill graph up on the first prompt, capture it on the second and replay it on the third, each into a
    fresh cache; each prompt's logits, and a decode step after it, match the uncompiled graph on the reference ops."""
    from lrkv_compile.lowering import triton_prefill
    from torch._dynamo.utils import counters

    rebuilt, rebuild = [], triton_prefill._rebuilt_attention
    monkeypatch.setattr(triton_prefill, "_rebuilt_attention",
                        lambda *args: rebuilt.append(triton_prefill._capturing(args[0])) or rebuild(*args))

    model = build_model(dict(num_key_value_heads=2, num_attention_heads=8, head_dim=64, hidden_size=128,
                             attention_bias=False, num_hidden_layers=2, dtype=torch.float16, seed=0)).cuda()
    plan = lrkv.RankPlan.uniform(model, keep=0.5, bits=4, group=8, progress=False)
    tokens = max(80, triton_prefill.REBUILD_TOKENS)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (2, tokens), generator=generator).cuda() for _ in range(3)]
    counters.clear()
    logits = {}
    for name, options in {"reference": dict(inductor=False, kernels="reference"),
                          "cuda graphs": dict(mode="reduce-overhead")}.items():
        lm = lrkv.compile(model, plan, **options)
        steps = []
        with torch.no_grad():
            for prompt in prompts:
                cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=tokens + 8)
                cached = {cache_keyword(model): cache, "use_cache": True}
                prefill = lm(input_ids=prompt, **cached).logits.float().clone()
                decode = lm(input_ids=prompt[:, -1:], **cached).logits.float().clone()
                steps.append((prefill, decode))
        logits[name] = steps
    assert not counters["inductor"]["cudagraph_skips"], "Inductor ran the steps without CUDA graphs"
    assert False in rebuilt and True in rebuilt, f"the rebuild path ran {rebuilt} (True: under capture)"
    for (prefill, decode), (expected_prefill, expected_decode) in zip(logits["cuda graphs"], logits["reference"]):
        torch.testing.assert_close(prefill, expected_prefill, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(decode, expected_decode, atol=2e-2, rtol=2e-2)
