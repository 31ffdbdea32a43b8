"""Every architecture family lrkv knows (`lrkv_compile.zoo`), random weights: a full-rank 16-bit plan is the
original model through the backend and through generate() with a LatentCache, and a budget-0.25 plan compiles
and generates the eager low-rank reference's tokens."""
import warnings

import pytest
import torch

import lrkv_compile as lrkv
from lrkv_compile import zoo
from lrkv_compile.reference import stepwise
from lrkv_compile.trace import cache_keyword
from strategies import TOLERANCE

FAMILIES = zoo.names()


def left_padded_prompt(rows=2, tokens=7, seed=0):
    """Token ids and attention mask; the first row is shorter by 2 (left padding)."""
    ids = torch.randint(3, zoo.VOCAB, (rows, tokens), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    return ids, mask


def greedy(generate, ids, mask):
    out = generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, 1)


def generates_as_the_original(model, plan):
    """Greedy generation through lrkv.compile and a LatentCache gives the original model's tokens and logits on
    the left-padded prompt; returns the compiled model (its `cache` holds the run's LatentCache)."""
    ids, mask = left_padded_prompt()
    with warnings.catch_warnings():  # a full-rank LatentCache saves no memory, and says so
        warnings.simplefilter("ignore", lrkv.LrkvWarning)
        compiled = lrkv.compile(model, plan)
        sequences, step_logits = greedy(compiled.generate, ids, mask)
    stock_sequences, stock_logits = greedy(model.generate, ids, mask)
    assert torch.equal(sequences, stock_sequences)
    torch.testing.assert_close(step_logits, stock_logits, **TOLERANCE[torch.float32])
    return compiled


@pytest.mark.parametrize("family", FAMILIES)
def test_a_full_rank_plan_is_the_original_model(family):
    model = zoo.build(family, layers=3)
    plan = lrkv.RankPlan.uniform(model, keep=1.0, progress=False)
    ids, mask = left_padded_prompt()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
    got = forward(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    torch._dynamo.reset()

    compiled = generates_as_the_original(model, plan)
    assert all(type(layer).__name__ == "LatentLayer" for layer in compiled.cache.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_budget_plan_decodes_as_its_low_rank_reference(family):
    model = zoo.build(family, layers=3)
    batches = torch.randint(3, zoo.VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    plan = lrkv.calibrate(model, batches, budget=0.25, method="uniform", progress=False)
    assert plan.budget <= 0.25 and any(site.k_layout.bits != 16 or site.v_layout.bits != 16 for site in plan.sites)
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(3, zoo.VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=16)
    compiled = lrkv.compile(model, plan)
    with torch.no_grad(), stepwise(reference):
        for start, end in ((0, 7), (7, 8), (8, 9), (9, 12)):
            positions = torch.arange(start, end)[None].expand(2, -1)  # as generate() passes them
            got = compiled(input_ids=ids[:, start:end], position_ids=positions, **{cache_keyword(model): cache},
                           use_cache=True).logits
            expected = reference(input_ids=ids[:, :end], use_cache=False).logits[:, start:]
            torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    assert cache.nbytes() < 0.5 * cache.full_cache_nbytes()
    sequences = compiled.generate(ids[:, :5], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert sequences.shape == (2, 8)


ROPE_SCALING = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("variant", [*ROPE_SCALING, "eager attention"])
def test_rope_scaling_variants_and_eager_attention_are_rewritten_exactly(variant):
    """RoPE scaling changes only inv_freq and the attention scaling, which a LatentCache rebuilds from; the eager
    attention form (matmul, softmax, matmul) matches as SDPA does."""
    if variant == "eager attention":
        model = zoo.build("llama", layers=2, attention="eager")
    else:
        model = zoo.build("llama", layers=2, rope_parameters={**ROPE_SCALING[variant], "rope_theta": 10000.0})
        assert model.model.rotary_emb.rope_type == variant
    generates_as_the_original(model, lrkv.RankPlan.uniform(model, keep=1.0, progress=False))


def test_dynamic_ntk_rope_is_rewritten_with_each_tokens_rows():
    """Dynamic NTK scaling recomputes its frequencies from the longest position of each call (deciding in Python,
    so Dynamo splits the forward and the decoder layers get cos/sin as graph inputs) and a stock cache keeps each
    key rotated with its own step's frequencies: a LatentCache stores each token's cos/sin rows. Generation runs
    past the original length (8), where the frequencies change, as the original model."""
    def build(rope_type):
        model = zoo.build("llama", layers=2, max_position_embeddings=8,
                          rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e4})
        with torch.no_grad():  # sharp attention, weighed heavily: logits that tell RoPE frequencies apart
            for layer in model.model.layers:
                for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    projection.weight.mul_(16)
                layer.self_attn.o_proj.weight.mul_(30)
        return model
    model = build("dynamic")
    plan = lrkv.RankPlan.uniform(model, keep=1.0, progress=False)
    assert [row["key chain"] for row in lrkv.explain(model, plan, show=False)] == [
        "RoPE (frequencies recomputed per call: cos/sin stored per token)"] * 2
    ids, mask = left_padded_prompt()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
    torch.testing.assert_close(forward(input_ids=ids, attention_mask=mask, use_cache=False).logits, expected,
                               **TOLERANCE[torch.float32])
    torch._dynamo.reset()

    compiled = generates_as_the_original(model, plan)
    stock_logits = greedy(model.generate, ids, mask)[1]
    _, unscaled_logits = greedy(build("default").generate, ids, mask)  # the same weights: the scaling took effect
    assert (stock_logits[:, -1] - unscaled_logits[:, -1]).abs().max() > 10 * TOLERANCE[torch.float32]["atol"]
    rows = compiled.cache.rope_rows  # [batch, slots, cos | sin, rotary_dim], one per token for all layers
    assert rows.shape == (2, 256, 2, 16) and rows.dtype == torch.float32
    # row 1 (no padding) holds position p in slot p: the prompt's and the first step's rows (positions < 8) turn at
    # the original frequencies; the later steps' at the frequencies grown for their own length, each its own
    original = model.model.rotary_emb.original_inv_freq
    for slot, length in ((0, 8), (7, 8), (8, 9), (9, 10)):
        grown = original if length <= 8 else original * (2.0 * length / 8 - 1) ** (-torch.arange(8) / 7)
        torch.testing.assert_close(rows[1, slot, 0, :8], torch.cos(slot * grown))
    assert compiled.cache.nbytes() - compiled.cache.positions.nbytes - rows.nbytes == sum(
        t.nbytes for layer in compiled.cache.layers for t in layer.tensors())

    budget = lrkv.calibrate(model, torch.randint(3, zoo.VOCAB, (2, 24), generator=torch.Generator().manual_seed(1)),
                            budget=0.25, method="uniform", progress=False)
    assert budget.budget <= 0.25
    sequences = lrkv.compile(model, budget).generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                                     pad_token_id=0)
    assert sequences.shape == (2, 11)


def test_longrope_is_rewritten_with_each_tokens_rows():
    """Phi-3's longrope switches from its short to its long factors once a call passes the original length (8),
    overwriting inv_freq inside the graph: a LatentCache stores each token's cos/sin rows, and generation past the
    switch gives the original model's tokens and logits."""
    model = zoo.build("phi3", layers=2, max_position_embeddings=32, original_max_position_embeddings=8,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                       "long_factor": [float(i + 2) for i in range(8)],
                                       "original_max_position_embeddings": 8})
    compiled = generates_as_the_original(model, lrkv.RankPlan.uniform(model, keep=1.0, progress=False))
    rows = compiled.cache.rope_rows
    assert rows.shape == (2, 256, 2, 16)
    assert not torch.allclose(rows[1, 9, 0], torch.cos(9 * model.model.rotary_emb.original_inv_freq).repeat(2))


def test_recomputing_rope_is_found_through_decorators_outside_transformers_update():
    """On transformers 5.21-5.23 Phi-3's rotary forward has torch.no_grad() outside `dynamic_rope_update`: lrkv
    still finds that longrope recomputes its frequencies (so the cache stores cos/sin rows), and the function
    one_graph traces in its place is the undecorated forward (whatever the version at hand)."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    from lrkv_compile import rotary

    class Rotary(torch.nn.Module):
        rope_type = "longrope"

        @torch.no_grad()
        @dynamic_rope_update
        def forward(self, x, position_ids):
            return position_ids

    assert rotary.recomputes(Rotary())
    assert not rotary.recomputes(type("Plain", (Rotary,), {"rope_type": "default"})())
    inner = rotary._update_wrapper(Rotary.forward).__wrapped__
    assert inner.__code__ is not rotary._UPDATED and not hasattr(inner, "__wrapped__")


def test_sites_without_rope_score_in_latent_space(monkeypatch):
    """No RoPE and no key norm (OPT, GPT-2): q k^T = (q B_k^T) c^T + q b_k, so no key is ever rebuilt."""
    from lrkv_compile.lowering import reference

    def no_keys(*args, **kwargs):
        raise AssertionError("keys were rebuilt for a site without RoPE")
    monkeypatch.setattr(reference, "reconstruct_keys", no_keys)
    model = zoo.build("opt", layers=2)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    ids, mask = left_padded_prompt()
    sequences, step_logits = greedy(lrkv.compile(model, plan).generate, ids, mask)
    expected_sequences, expected_logits = greedy(lrkv.low_rank_reference(model, plan).generate, ids, mask)
    assert torch.equal(sequences, expected_sequences)
    torch.testing.assert_close(step_logits, expected_logits, **TOLERANCE[torch.float32])


def test_gpt_j_interleaved_rope_from_its_table_is_rewritten_partial_or_full():
    """GPT-J rotates interleaved channel pairs (2i, 2i + 1) with sin/cos read by position from a table, on [batch,
    tokens, heads, head_dim] keys: matched over its first channels (the zoo's family) or all of them, sin/cos read
    from the table at a LatentCache's stored positions, and it generates as the original model. The Triton decode
    kernel computes RoPE from inv_freq, so kernels='triton' says why it does not apply."""
    partial = zoo.build("gptj", layers=1)
    assert [row["key chain"] for row in lrkv.explain(partial, show=False)] == ["partial interleaved RoPE (8 of 16)"]
    model = zoo.build("gptj", layers=2, rotary_dim=16)
    plan = lrkv.RankPlan.uniform(model, keep=1.0, progress=False)
    rows = lrkv.explain(model, plan, show=False)
    assert [(row["status"], row["key chain"]) for row in rows] == [("matched", "interleaved RoPE")] * 2
    ids, mask = left_padded_prompt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lrkv.LrkvWarning)
        sequences, step_logits = greedy(lrkv.compile(model, plan).generate, ids, mask)
        cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=8)
    stock_sequences, stock_logits = greedy(model.generate, ids, mask)
    assert torch.equal(sequences, stock_sequences)
    torch.testing.assert_close(step_logits, stock_logits, **TOLERANCE[torch.float32])
    with pytest.raises(lrkv.KernelUnavailableError, match="not from the model's cos/sin tables"), torch.no_grad():
        lrkv.compile(model, plan, kernels="triton")(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True)


def test_the_readme_lists_every_family_with_what_is_rewritten():
    from pathlib import Path
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for family in zoo.FAMILIES.values():
        assert f"| `{family.name}` | {family.config.removesuffix('Config')} | {family.rewritten} |" in readme
