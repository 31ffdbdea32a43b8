"""Every architecture family lrkv knows (`lrkv_compile.zoo`), random weights: a full-rank 16-bit plan is the
original model through the backend and through generate() with a LatentCache, and a budget-0.25 plan compiles
and generates the eager low-rank reference's tokens."""
import warnings

import pytest
import torch

import lrkv_compile as lrkv
from lrkv_compile import zoo
from lrkv_compile.reference import stepwise
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

    with warnings.catch_warnings():  # a full-rank LatentCache saves no memory, and says so
        warnings.simplefilter("ignore", lrkv.LrkvWarning)
        compiled = lrkv.compile(model, plan)
        sequences, step_logits = greedy(compiled.generate, ids, mask)
    stock_sequences, stock_logits = greedy(model.generate, ids, mask)
    assert torch.equal(sequences, stock_sequences)
    torch.testing.assert_close(step_logits, stock_logits, **TOLERANCE[torch.float32])
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
            got = compiled(input_ids=ids[:, start:end], position_ids=positions, past_key_values=cache,
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
    plan = lrkv.RankPlan.uniform(model, keep=1.0, progress=False)
    ids, mask = left_padded_prompt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lrkv.LrkvWarning)
        sequences, step_logits = greedy(lrkv.compile(model, plan).generate, ids, mask)
    stock_sequences, stock_logits = greedy(model.generate, ids, mask)
    assert torch.equal(sequences, stock_sequences)
    torch.testing.assert_close(step_logits, stock_logits, **TOLERANCE[torch.float32])


def test_dynamic_rope_scaling_is_a_clear_error():
    """Dynamic NTK scaling recomputes its frequencies in Python from the sequence length: no single graph."""
    model = zoo.build("llama", layers=1, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(lrkv.UnrewrittenSiteError, match="RoPE scaling is 'dynamic'.*use 'linear', 'llama3' or 'yarn'"):
        lrkv.explain(model, show=False)


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
        lrkv.compile(model, plan, kernels="triton")(input_ids=ids, past_key_values=cache, use_cache=True)


def test_the_readme_lists_every_family_with_what_is_rewritten():
    from pathlib import Path
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for family in zoo.FAMILIES.values():
        assert f"| `{family.name}` | {family.config.removesuffix('Config')} | {family.rewritten} |" in readme
