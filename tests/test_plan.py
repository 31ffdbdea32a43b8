"""Plans: factorization contract, validation, the file format and its errors."""
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

import lrkv_compile as lrkv
from lrkv_compile.passes.factorize import factorize, whitening_factor
from strategies import build_model

SMALL = dict(num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=32, attention_bias=False,
             num_hidden_layers=2, dtype=torch.float32, seed=0)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(out_blocks=st.integers(1, 4), block_out=st.sampled_from([4, 8]), extra_in=st.integers(0, 8),
       whiten=st.booleans())
def test_full_rank_factors_reproduce_the_weight(out_blocks, block_out, extra_in, whiten):
    out_features = out_blocks * block_out
    weight = torch.randn(out_features, out_features + extra_in)
    activations = torch.randn(256, weight.shape[1]) * torch.linspace(0.1, 3, weight.shape[1])
    whitening = whitening_factor(activations.double().T @ activations.double() / 256) if whiten else None
    down, up = factorize(weight, whitening, out_blocks, out_features)
    torch.testing.assert_close(down @ up, weight.T, atol=1e-4, rtol=1e-4)


def test_whitening_lowers_the_output_error_on_the_calibration_activations():
    torch.manual_seed(0)
    weight = torch.randn(16, 32)
    activations = torch.randn(512, 32) @ torch.randn(32, 32)  # correlated inputs
    gram = activations.double().T @ activations.double() / 512
    plain = factorize(weight, None, 1, 6)
    whitened = factorize(weight, whitening_factor(gram), 1, 6)
    error = [((activations @ (d @ u)) - activations @ weight.T).norm() for d, u in (plain, whitened)]
    assert error[1] < error[0]


def test_save_load_roundtrip(tmp_path):
    model = build_model(SMALL)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, scheme="hybrid", progress=False)
    plan.save(tmp_path / "plan.safetensors")
    loaded = lrkv.RankPlan.load(tmp_path / "plan.safetensors")
    assert loaded == plan and loaded.keep == pytest.approx(0.5)
    assert loaded.sites[0].k_scheme == "head" and loaded.sites[0].v_scheme == "joint"
    for a, b in zip(plan.sites, loaded.sites):
        assert torch.equal(a.down_k, b.down_k) and torch.equal(a.up_v, b.up_v)


def test_corrupt_plan_files_raise_clear_errors(tmp_path):
    model = build_model(SMALL)
    path = tmp_path / "plan.safetensors"
    lrkv.RankPlan.uniform(model, keep=0.5, progress=False).save(path)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(lrkv.CorruptPlanError, match="truncated.safetensors"):
        lrkv.RankPlan.load(truncated)
    with pytest.raises(lrkv.CorruptPlanError, match="no such plan file"):
        lrkv.RankPlan.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(lrkv.CorruptPlanError, match="not an lrkv plan"):
        lrkv.RankPlan.load(tmp_path / "other.safetensors")
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        meta = json.loads(handle.metadata()["lrkv_plan"])
    meta["sites"][0]["rank_k"] = 999
    save_file(tensors, str(tmp_path / "edited.safetensors"), metadata={"lrkv_plan": json.dumps(meta)})
    with pytest.raises(lrkv.CorruptPlanError, match="checksum"):
        lrkv.RankPlan.load(tmp_path / "edited.safetensors")
    del meta["checksum"]  # a file from before checksums: the field's own validation names it
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={"lrkv_plan": json.dumps(meta)})
    with pytest.raises(lrkv.PlanError, match="rank_k=999"), pytest.warns(lrkv.LrkvWarning, match="no checksum"):
        lrkv.RankPlan.load(tmp_path / "bad.safetensors")


def test_plan_validation_names_the_field():
    model = build_model(SMALL)
    with pytest.raises(lrkv.PlanError, match="keep=1.5"):
        lrkv.RankPlan.uniform(model, keep=1.5, progress=False)
    with pytest.raises(lrkv.PlanError, match="group_size=4 does not divide num_kv_heads=2"):
        lrkv.RankPlan.uniform(model, keep=0.5, scheme="group", progress=False)
    site = lrkv.RankPlan.uniform(model, keep=0.5, progress=False).sites[0]
    factors = dict(down_k=site.down_k, up_k=site.up_k, down_v=site.down_v, up_v=site.up_v)
    with pytest.raises(lrkv.PlanError, match="v_layout: bits=5"):
        type(site)(**{**site.metadata(), "v_layout": {"bits": 5}}, **factors)
    with pytest.raises(lrkv.PlanError, match="group=32 does not divide the 16 quantized channels of rank_k=16"):
        type(site)(**{**site.metadata(), "k_layout": {"bits": 4, "group": 32}}, **factors)
    with pytest.raises(lrkv.PlanError, match="group=8 does not divide the 12 quantized channels"):
        type(site)(**{**site.metadata(), "k_layout": {"bits": 4, "group": 8, "outliers": 4}}, **factors)
    with pytest.raises(lrkv.PlanError, match="outliers=16 needs a joint-scheme side"):
        type(site)(**{**site.metadata(), "k_layout": {"bits": 4, "group": 8, "outliers": 16}}, **factors)
    with pytest.raises(lrkv.PlanError, match="K latents: bits=5"):
        lrkv.RankPlan.uniform(model, keep=0.5, bits_k=5, progress=False)
    with pytest.raises(lrkv.PlanError, match="calibration batch 0"):
        lrkv.calibrate(model, [torch.randn(2, 8)], keep=0.5)


def test_plan_of_another_model_is_rejected():
    plan = lrkv.RankPlan.uniform(build_model(SMALL), keep=0.5, progress=False)
    other = build_model({**SMALL, "head_dim": 8})
    with pytest.raises(lrkv.PlanMismatchError, match="plan"):
        lrkv.low_rank_reference(other, plan)
    forward = torch.compile(other.forward, backend="lrkv", options={"plan": plan})
    with pytest.raises(Exception, match="does not fit this model"):
        forward(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)


def test_backend_option_errors():
    model = build_model(SMALL)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(Exception, match="needs a plan"):
        torch.compile(model.forward, backend="lrkv")(input_ids=ids, use_cache=False)
    torch._dynamo.reset()
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    with pytest.raises(Exception, match="unknown lrkv option"):
        torch.compile(model.forward, backend="lrkv", options={"plan": plan, "rank": 3})(input_ids=ids, use_cache=False)
    with pytest.raises(lrkv.PlanError, match=r"options\['kernels'\]='cuda'; choose one of \('auto', 'reference', 'triton'\)"):
        lrkv.compile(model, plan, kernels="cuda")
    with pytest.raises(lrkv.PlanError, match=r"options\['inductor'\]='yes'"):
        lrkv.compile(model, plan, inductor="yes")
    with pytest.raises(lrkv.PlanError, match=r"options\['mode'\]='fast'; choose one of \('default', 'reduce-overhead'"):
        lrkv.compile(model, plan, mode="fast")
    with pytest.raises(lrkv.PlanError, match=r"'reduce-overhead' is a mode of Inductor, but options\['inductor'\] is False"):
        lrkv.compile(model, plan, mode="reduce-overhead", inductor=False)


def test_up_factors_have_orthonormal_rows():
    """Singular values live in `down`, so a latent's (quantization) error reaches K/V with its own norm."""
    weight = torch.randn(16, 32)
    activations = torch.randn(256, 32) * torch.linspace(0.1, 3, 32)
    whitening = whitening_factor(activations.double().T @ activations.double() / 256)
    for blocks in (1, 2, 4):
        _, up = factorize(weight, whitening, blocks, 8)
        torch.testing.assert_close(up @ up.T, torch.eye(8), atol=1e-5, rtol=0)
