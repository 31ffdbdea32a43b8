"""Site discovery by structure, reports, and what happens to what does not match."""
import pytest
import torch

import lrkv_compile as lrkv
from lrkv_compile.passes.sites import find_sites, parameter_name
from lrkv_compile.trace import capture
from strategies import TOLERANCE, build_model

SMALL = dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32, attention_bias=True,
             num_hidden_layers=2, dtype=torch.float32, seed=0)


def test_placeholder_names_parse_to_the_parameter_names():
    model = build_model(SMALL)
    gm, _, _, name_of = capture(model, torch.arange(6)[None])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and name_of(n)]
    assert placeholders
    for node in placeholders:
        assert parameter_name(node) == name_of(node)


def test_explain_reports_sites_ranks_and_value_path():
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    rows = lrkv.explain(model, plan, show=False)
    assert [r["layer"] for r in rows] == [0, 1]
    assert rows[0]["k_weight"] == "model.layers.0.self_attn.k_proj.weight"
    assert rows[0]["key chain"] == "RoPE" and rows[0]["heads"] == "4/2" and rows[0]["bias"] is True
    assert rows[0]["bytes/token"] == f"{plan.sites[0].bytes_per_token(plan.context):.1f} of {2 * 2 * 2 * 16}"
    assert rows[0]["rank_k"] == 16 and rows[0]["value_path"] in ("up after reduction", "absorbed into output projection")


def unknown_keys(model, layers=None):
    """`model` with keys the matcher does not know (tanh after the K projection, by a forward hook) in `layers`
    (default all): the same parameters, another graph."""
    for index, layer in enumerate(model.model.layers):
        if layers is None or index in layers:
            layer.self_attn.k_proj.register_forward_hook(lambda module, args, out: torch.tanh(out))
    return model


def test_an_unknown_key_layout_is_reported_unmatched_and_left_untouched():
    model = unknown_keys(build_model({**SMALL, "num_hidden_layers": 1}))
    rows = lrkv.explain(model, show=False)
    assert len(rows) == 1 and rows[0]["status"].startswith("unmatched")
    assert "the heads come from another operation than a linear projection" in rows[0]["status"]
    with pytest.raises(lrkv.PlanError, match="no attention site"):
        lrkv.RankPlan.uniform(model, keep=0.5, progress=False)


def test_plan_whose_sites_do_not_match_is_an_error_not_the_original_model():
    """Compiling a model whose attention the matcher cannot handle under a plan raises; it never returns the
    uncompressed model's numbers as the plan's."""
    plan = lrkv.RankPlan.uniform(build_model({**SMALL, "num_hidden_layers": 1}), keep=0.5, progress=False)
    model = unknown_keys(build_model({**SMALL, "num_hidden_layers": 1}))  # the same weights: only the graph differs
    with pytest.raises(lrkv.UnrewrittenSiteError, match="did not match"):
        lrkv.compile(model, plan)
    with pytest.raises(Exception, match="did not match"), pytest.warns(lrkv.LrkvWarning, match="left untouched"):
        torch.compile(model.forward, backend="lrkv", options={"plan": plan})(input_ids=torch.randint(0, 61, (1, 7)))


def test_find_sites_records_cache_kind():
    model = build_model(SMALL)
    gm, _, _, name_of = capture(model, torch.arange(6)[None])
    sites, unmatched = find_sites(gm, name_of)
    assert not unmatched and [s.cache for s in sites] == ["none", "none"]
    assert sites[0].out_proj is not None and sites[0].rope is not None


def test_a_model_with_an_unknown_layer_in_the_middle_runs_it_stock_beside_latent_ones():
    """The matcher leaves layer 1 untouched (reported); the plan covers layers 0 and 2, and a LatentCache holds
    layer 1's full keys and values in a stock layer."""
    model = unknown_keys(build_model({**SMALL, "num_hidden_layers": 3}), layers={1})
    with pytest.warns(lrkv.LrkvWarning, match="did not match and are left out of the plan"):
        plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    assert [site.layer for site in plan.sites] == [0, 2]
    ids = torch.randint(0, 61, (1, 6))
    with pytest.warns(lrkv.LrkvWarning, match="left untouched"):
        compiled = lrkv.compile(model, plan)
        out = compiled.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    assert [type(layer).__name__ for layer in compiled.cache.layers] == ["LatentLayer", "StaticLayer", "LatentLayer"]
    with torch.no_grad():
        expected = lrkv.low_rank_reference(model, plan)(out.sequences).logits[:, ids.shape[1] - 1:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1), expected, **TOLERANCE[torch.float32])


def test_gpt_j_keys_are_matched_with_interleaved_rope_read_from_its_table():
    """GPT-J: RoPE on [batch, tokens, heads, head_dim] keys, turned after it; sin | cos columns of one table gathered
    at the positions, each doubled over interleaved pairs; scores in float32 divided by sqrt(head_dim)."""
    from lrkv_compile import zoo
    model = zoo.build("gptj", layers=1)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    cache = lrkv.LatentCache(model, plan, max_batch_size=1, max_cache_len=8)
    gm, _, _, name_of = capture(model, torch.arange(6)[None], cache=cache)
    sites, unmatched = find_sites(gm, name_of)
    assert not unmatched and len(sites) == 1
    site = sites[0]
    assert site.cache == "latent" and site.k_weight == "transformer.h.0.attn.k_proj.weight"
    assert site.rope.interleaved and site.rope.rotary_dim == 8 and site.head_dim == 16
    assert site.rope_source.inv_freq is None
    # the model's own sin | cos buffer (on the attention module up to transformers 5.23, its rotary module after)
    assert name_of(site.rope_source.table) in ("transformer.h.0.attn.embed_positions",
                                               "transformer.rotary_emb.embed_positions")
    assert (site.rope_source.sin_columns, site.rope_source.cos_columns) == ((0, 4), (4, 8))
    assert site.scale == 0.25 and site.num_heads == site.num_kv_heads == 4
