"""Plans carried over to another model: another layer count, heads, head_dim, GQA ratio and architecture."""
import subprocess
import sys

import pytest
import torch

import lrkv_compile as lrkv
from lrkv_compile import zoo
from lrkv_compile.reference import stepwise
from lrkv_compile.trace import cache_keyword
from lrkv_compile.transfer import latent_share, transfer_with_mapping
from strategies import TOLERANCE


@pytest.fixture(scope="module")
def source_plan():
    """A budget plan made on a 5-layer Llama (8 query heads over 4 KV heads of 16)."""
    model = zoo.build("llama", layers=5, heads=8, kv_heads=4, head_dim=16, seed=1)
    batches = torch.randint(3, zoo.VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    return lrkv.calibrate(model, batches, budget=0.25, progress=False)


def test_a_plan_carries_over_to_another_architecture_within_its_budget(source_plan):
    target = zoo.build("qwen3", layers=3, heads=4, kv_heads=2, head_dim=32, seed=2)
    batches = torch.randint(3, zoo.VOCAB, (2, 64), generator=torch.Generator().manual_seed(3))
    plan, mapping = transfer_with_mapping(source_plan, target, batches, progress=False, show=False)
    assert len(plan.sites) == 3
    assert 0.8 * latent_share(source_plan) < latent_share(plan) <= latent_share(source_plan)
    assert [row.source_layer for row in mapping[::2]] == [0, 2, 4]  # relative depth: first, middle, last
    # another depth: every layer gets the same share, and its K and V stay within it
    assert len({round(row.layer_share, 9) for row in mapping}) == 1
    layer_share = {row.layer: row.layer_share for row in mapping}
    for site in plan.sites:
        assert site.bytes_per_token(plan.context) <= layer_share[site.layer] * 4 * site.full_dim * (1 + 1e-9)
    assert plan.calibration_tokens == batches.numel() and "transferred" in plan.source
    lrkv.check(target, plan)
    reference = lrkv.low_rank_reference(target, plan)
    compiled = lrkv.compile(target, plan)
    ids = torch.randint(3, zoo.VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    cache = lrkv.LatentCache(target, plan, max_cache_len=16)
    with torch.no_grad(), stepwise(reference):
        for start, end in ((0, 6), (6, 7), (7, 10)):
            got = compiled(input_ids=ids[:, start:end], position_ids=torch.arange(start, end)[None],
                           **{cache_keyword(target): cache}, use_cache=True).logits
            torch.testing.assert_close(got, reference(input_ids=ids[:, :end]).logits[:, start:],
                                       **TOLERANCE[torch.float32])


def test_a_target_of_the_source_depth_follows_its_layer_shares(source_plan):
    """Same number of layers (other heads and head_dim): each layer gets the share of the source layer at its
    depth, scaled to the source's budget."""
    target = zoo.build("mistral", layers=5, heads=4, kv_heads=2, head_dim=32, seed=9)
    batches = torch.randint(3, zoo.VOCAB, (2, 64), generator=torch.Generator().manual_seed(10))
    plan, mapping = transfer_with_mapping(source_plan, target, batches, progress=False, show=False)
    source_shares = torch.tensor([site.bytes_per_token(source_plan.context) / (4 * site.full_dim)
                                  for site in source_plan.sites], dtype=torch.float64)
    shares = torch.tensor([row.layer_share for row in mapping[::2]], dtype=torch.float64)
    torch.testing.assert_close(shares / shares.sum(), source_shares / source_shares.sum())
    assert latent_share(plan) <= latent_share(source_plan)


def test_a_full_rank_plan_carried_to_a_fine_tune_is_its_own_model():
    """Same architecture, other weights (a fine-tune): a full-rank 16-bit plan re-estimated on the target gives
    the target's own logits, where the source's factors would not fit it."""
    source = zoo.build("llama", layers=2, seed=5)
    tuned = zoo.build("llama", layers=2, seed=6)
    plan = lrkv.RankPlan.uniform(source, keep=1.0, progress=False)
    with pytest.raises(lrkv.PlanMismatchError, match="lrkv.transfer"):
        lrkv.compile(tuned, plan)
    carried, mapping = transfer_with_mapping(plan, tuned, torch.randint(3, zoo.VOCAB, (2, 32)), progress=False,
                                             show=False)
    assert all(row.note == "the source's layout" and row.rank == row.full_dim for row in mapping)
    ids = torch.randint(3, zoo.VOCAB, (2, 8))
    with torch.no_grad():
        expected = tuned(input_ids=ids).logits
    got = lrkv.compile(tuned, carried)(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_transfer_inputs_are_checked(source_plan):
    target = zoo.build("llama", layers=2)
    with pytest.raises(lrkv.PlanError, match="RankPlan or the path"):
        lrkv.transfer({"sites": []}, target, torch.randint(3, zoo.VOCAB, (1, 16)), show=False)
    with pytest.raises(lrkv.PlanError, match="no calibration batches"):
        lrkv.transfer(source_plan, target, [], show=False)


def test_the_transfer_command_writes_a_plan_for_the_target(tmp_path):
    """`lrkv transfer PLAN --model PATH -o OUT`, with a Hugging Face model folder and the user's text."""
    source = zoo.build("llama", layers=2, seed=7)
    plan = lrkv.RankPlan.uniform(source, keep=0.5, progress=False)
    plan.save(tmp_path / "source.safetensors")
    target = zoo.build("mistral", layers=3, heads=4, kv_heads=1, head_dim=16, seed=8)
    target.save_pretrained(tmp_path / "target")
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocabulary = {word: index for index, word in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(90)])}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path / "target")
    (tmp_path / "text.txt").write_text(" ".join(f"w{(i * 7) % 90}" for i in range(400)))
    result = subprocess.run([sys.executable, "-m", "lrkv_compile.cli", "transfer", str(tmp_path / "source.safetensors"),
                             "--model", str(tmp_path / "target"), "--text", str(tmp_path / "text.txt"),
                             "--rows", "2", "--length", "64", "-o", str(tmp_path / "carried.safetensors")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "lrkv transfer: 2-layer plan" in result.stdout
    carried = lrkv.RankPlan.load(tmp_path / "carried.safetensors")
    assert len(carried.sites) == 3 and carried.sites[0].k_weight == "model.layers.0.self_attn.k_proj.weight"
