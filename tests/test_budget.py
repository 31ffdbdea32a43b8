"""Budget plans: calibration that chooses each site's K/V rank, bits and group under a byte budget."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import lrkv_compile as lrkv
from lrkv_compile.allocate import Candidate, _frontier, search, uniform
from lrkv_compile.calibrate import collect_stats
from lrkv_compile.reference import stepwise
from lrkv_compile.trace import cache_keyword
from strategies import TOLERANCE, VOCAB, build_model

SPEC = dict(num_key_value_heads=4, num_attention_heads=8, head_dim=16, hidden_size=64, attention_bias=False,
            num_hidden_layers=6, dtype=torch.float32, seed=3)


@pytest.fixture(scope="module")
def calibrated():
    model = build_model(SPEC)
    batches = torch.randint(0, VOCAB, (4, 48), generator=torch.Generator().manual_seed(1))
    return model, collect_stats(model, batches, progress=False, fisher=True)


@pytest.mark.parametrize("budget", [0.5, 0.3, 0.2])
@pytest.mark.parametrize("method", ["search", "uniform", "fisher"])
def test_budget_is_reached_and_never_exceeded(calibrated, budget, method):
    model, stats = calibrated
    # at a short context the exact sinks and window weigh a lot: the accounting must amortise them right
    plan = lrkv.calibrate(model, stats=stats, budget=budget, method=method, context=80, sinks=2, window=16,
                          progress=False)
    cache = lrkv.LatentCache(model, plan, max_cache_len=80)
    held = cache.nbytes() / cache.full_cache_nbytes(torch.float16)
    assert held <= budget
    assert held >= budget * (0.97 if method == "search" else 0.5)
    assert held == pytest.approx(plan.budget, rel=1e-12)  # whatever the model's dtype: this one is float32


def test_search_spends_bytes_where_the_loss_is():
    """The search's estimated cost is at most the uniform setting's, at the same budget."""
    model = build_model(SPEC)
    stats = collect_stats(model, torch.randint(0, VOCAB, (4, 48)), progress=False, fisher=True)
    chosen = {}
    for method in ("search", "uniform"):
        plan = lrkv.calibrate(model, stats=stats, budget=0.25, method=method, progress=False)
        chosen[method] = plan
    losses = {}
    for method, plan in chosen.items():
        losses[method] = 0.0
        for site in plan.sites:
            for side in ("k", "v"):
                key = (site.layer, side, 1, "hadamard")
                found = {(c.rank, c.layout.bits, c.layout.group): c.cost for c in stats.scored[key]}
                layout = getattr(site, f"{side}_layout")
                losses[method] += found[getattr(site, f"rank_{side}"), layout.bits, layout.group]
    assert losses["search"] <= losses["uniform"]


def test_fisher_allocation_gives_more_rank_to_more_fisher_information(calibrated):
    """Palu: one bit width everywhere, and ranks ordered as the sides' Fisher information."""
    model, stats = calibrated
    plan = lrkv.calibrate(model, stats=stats, budget=0.25, method="fisher", progress=False)
    assert len({(site.k_layout.bits, site.v_layout.bits) for site in plan.sites}) == 1
    importance = {(site.index, side): float(stats.fisher[site.index, side].trace() * stats.grams[site.index].trace())
                  for site in stats.sites for side in "kv"}
    ranks = {(site.layer, side): getattr(site, f"rank_{side}") for site in plan.sites for side in "kv"}
    ordered = sorted(importance, key=importance.get)
    assert [ranks[key] for key in ordered] == sorted(ranks[key] for key in ordered)
    assert len(set(ranks.values())) > 1


def test_learned_ranks_fit_the_budget_and_need_the_text(calibrated):
    """STAR-KV: ranks from thresholds trained on the text, bits searched at those ranks, under the budget."""
    model, stats = calibrated
    batches = torch.randint(0, VOCAB, (4, 48), generator=torch.Generator().manual_seed(1))
    plan = lrkv.calibrate(model, batches, stats=stats, budget=0.25, method="learned", progress=False)
    assert 0.25 * 0.9 <= plan.budget <= 0.25 and plan.source == "calibrated: learned"
    with pytest.raises(lrkv.PlanError, match="method='learned' trains"):
        lrkv.calibrate(model, stats=stats, budget=0.25, method="learned", progress=False)


def test_a_budget_plan_through_a_latent_cache_equals_its_reference(calibrated):
    model, stats = calibrated
    plan = lrkv.calibrate(model, stats=stats, budget=0.2, progress=False)
    assert any(site.k_layout.bits != 16 for site in plan.sites)
    reference = lrkv.low_rank_reference(model, plan)
    ids = torch.randint(0, VOCAB, (2, 12))
    cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=12)
    lm = lrkv.compile(model, plan)
    with torch.no_grad(), stepwise(reference):
        for start, end in ((0, 6), (6, 7), (7, 12)):
            got = lm(input_ids=ids[:, start:end], **{cache_keyword(model): cache}, use_cache=True).logits
            expected = reference(input_ids=ids[:, :end], use_cache=False).logits[:, start:]
            torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_uncalibrated_budget_plans_are_full_rank_and_quantized():
    model = build_model(SPEC)
    plan = lrkv.calibrate(model, budget=0.4, method="none", progress=False)
    assert plan.budget <= 0.4 and plan.calibration_tokens == 0
    # per layer and side 64 channels at 4 bits = 32 B + 2 groups x 4 B, + 4 exact sink tokens x 128 B / 4096
    assert {(site.rank_k, site.rank_v) for site in plan.sites} == {(64, 64)}
    assert {site.k_layout for site in plan.sites} == {lrkv.Layout(bits=4, group=32, rotation="hadamard", sinks=4)}
    # 2 bits in groups of 64: 16 B + 4 B, + 0.125 B of sink tokens, per layer and side; + a 4 B position
    with pytest.raises(lrkv.PlanError, match="full-rank plan can reach, 0.1598"):
        lrkv.calibrate(model, budget=0.1, method="none", progress=False)


def test_bad_budgets_are_clear_errors(calibrated):
    model, stats = calibrated
    with pytest.raises(lrkv.PlanError, match="can reach at context=4096 with sinks=4 and window=0, 0.0496"):
        lrkv.calibrate(model, stats=stats, budget=0.01, progress=False)
    for bad in (0, 1.5, "0.2", True):
        with pytest.raises(lrkv.PlanError, match="budget="):
            lrkv.calibrate(model, stats=stats, budget=bad, progress=False)
    with pytest.raises(lrkv.PlanError, match="not both"):
        lrkv.calibrate(model, stats=stats, budget=0.2, keep=0.5)
    with pytest.raises(lrkv.PlanError, match="bits_v cannot be combined with budget="):
        lrkv.calibrate(model, stats=stats, budget=0.2, bits_v=3)
    with pytest.raises(lrkv.PlanError, match="method='greedy'"):
        lrkv.calibrate(model, stats=stats, budget=0.2, method="greedy")
    with pytest.raises(lrkv.PlanError, match="measures each choice on calibration text"):
        lrkv.RankPlan.uniform(model, budget=0.2)
    no_fisher = collect_stats(model, torch.randint(0, VOCAB, (1, 16)), progress=False)
    with pytest.raises(lrkv.PlanError, match="fisher=True"):
        lrkv.calibrate(model, stats=no_fisher, budget=0.2)


def test_the_fisher_statistics_are_positive_semidefinite_and_full_rank_8_bits_is_nearly_lossless(calibrated):
    model, stats = calibrated
    for matrix in stats.fisher.values():
        assert torch.allclose(matrix, matrix.T) and torch.linalg.eigvalsh(matrix).min() > -1e-9 * matrix.abs().max()
    lrkv.calibrate(model, stats=stats, budget=0.2, progress=False)  # scores the candidates (once per stats)
    found = stats.scored[0, "v", 1, "hadamard"]
    finest = min(c.loss for c in found if c.rank == 64 and c.layout.bits == 8)
    coarsest = max(c.loss for c in found)
    assert finest < 1e-3 * coarsest
    assert max(c.truncation for c in found if c.rank == 64) < 1e-6 * coarsest  # full rank truncates nothing
    lowest = min(c.rank for c in found)
    assert min(c.truncation for c in found if c.rank == lowest) > 1e-3 * coarsest  # a low rank does


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.tuples(st.integers(1, 40), st.floats(0, 100)), min_size=1, max_size=6), min_size=1,
                max_size=5), st.floats(0, 1))
def test_search_never_exceeds_the_budget_and_leaves_no_affordable_upgrade(sides, fraction):
    options = {key: [Candidate(1, lrkv.Layout(), size, loss, loss / 3) for size, loss in found]
               for key, found in enumerate(sides)}
    cheapest = sum(min(c.bytes for c in found) for found in options.values())
    most = sum(max(c.bytes for c in found) for found in options.values())
    budget = cheapest + fraction * (most - cheapest)
    choice = search(options, budget)
    spent = sum(c.bytes for c in choice.values())
    assert spent <= budget
    for key, current in choice.items():
        for better in _frontier(options[key]):
            assert not (current.bytes < better.bytes <= current.bytes + budget - spent and better.cost < current.cost)
    setting_options = {(site, side): found for site in range(2) for side in "kv"
                       for found in [[Candidate(r, lrkv.Layout(), r, 1.0 / r) for r in (1, 2, 4)]]}
    assert sum(c.bytes for c in uniform(setting_options, 9).values()) <= 9
