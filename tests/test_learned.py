"""Learned ranks (STAR-KV soft thresholds trained by distillation): budgets, a model left untouched, and
ranks that follow where the model needs them."""
import contextlib

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from lrkv_compile.allocate import candidate_ranks
from lrkv_compile.calibrate import collect_stats
from lrkv_compile.learned import _read_off, learn_ranks
from lrkv_compile.passes.factorize import factorize, whitening_factor

VOCAB, LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 61, 4, 2, 16, 64
FULL = KV_HEADS * HEAD_DIM
DEAD = 1  # the layer whose attention output is multiplied by zero in `dead_layer_model`


def tiny_model(seed=0, dead=None):
    """A random 4-layer Llama, hidden 64, 2 KV heads of 16; q/k/v initialised large enough that attention is
    far from uniform (so keys matter). `dead`: a layer whose o_proj is zeroed, so its K and V never matter."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=256, initializer_range=0.2)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    if dead is not None:
        with torch.no_grad():
            model.model.layers[dead].self_attn.o_proj.weight.zero_()
    return model


def setup(model, seed=1):
    batches = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(seed))
    stats = collect_stats(model, batches, progress=False)
    blocks = {(site.index, side): (KV_HEADS if side == "k" else 1) for site in stats.sites for side in ("k", "v")}
    choices = {key: candidate_ranks(FULL, HIDDEN, b) for key, b in blocks.items()}
    return batches, stats, blocks, choices


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_model()
    return (model, *setup(model))


@pytest.fixture(scope="module")
def dead_layer_model():
    model = tiny_model(dead=DEAD)
    return (model, *setup(model))


def snapshot(model):
    return {name: (param.detach().clone(), param.requires_grad) for name, param in model.named_parameters()}


def assert_untouched(model, before, ids, logits):
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (value, grad) in before.items():
        assert torch.equal(after[name][0], value) and after[name][1] == grad, name
        assert model.get_parameter(name).grad is None, name
    assert not any("forward" in module.__dict__ for module in model.modules())
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)


@contextlib.contextmanager
def truncated(model, stats, blocks, ranks):
    """The model with every K/V projection replaced by its whitened factorization at `ranks` (hard cut)."""
    params = dict(model.named_parameters())
    modules = []
    for site in stats.sites:
        whitening = whitening_factor(stats.grams[site.index] / stats.tokens)
        for side, name in (("k", site.k_weight), ("v", site.v_weight)):
            down, up = factorize(params[name].detach(), whitening, blocks[site.index, side], ranks[site.index, side])
            module = model.get_submodule(name.removesuffix(".weight"))
            module.forward = lambda x, down=down, up=up: (x @ down) @ up
            modules.append(module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def kd_loss(model, stats, blocks, ranks, batches):
    """Mean per-token KL(original || truncated at `ranks`) of the next-token distributions."""
    with torch.no_grad():
        teacher = torch.log_softmax(model(input_ids=batches).logits, -1)
        with truncated(model, stats, blocks, ranks):
            student = torch.log_softmax(model(input_ids=batches).logits, -1)
    return float((teacher.exp() * (teacher - student)).sum(-1).mean())


@pytest.mark.parametrize("share", ["lowest", 0.3, 0.5, 0.75, "full", "above full"])
def test_ranks_are_allowed_and_fit_the_total(calibrated, share):
    model, batches, stats, blocks, choices = calibrated
    lowest = sum(found[0] for found in choices.values())
    full = sum(found[-1] for found in choices.values())
    total = {"lowest": lowest, "full": full, "above full": full + 5}.get(share) or int(share * full) + 3
    ranks = learn_ranks(model, batches, stats, blocks, choices, total, steps=12, progress=False)
    assert ranks.keys() == choices.keys()
    assert all(rank in choices[key] for key, rank in ranks.items())
    assert sum(ranks.values()) <= total
    # the rank left over is less than any single step up (the repair spends what it can)
    left = total - sum(ranks.values())
    assert all(rank == choices[key][-1] or choices[key][choices[key].index(rank) + 1] - rank > left
               for key, rank in ranks.items())
    if share == "lowest":
        assert ranks == {key: found[0] for key, found in choices.items()}
    with pytest.raises(ValueError, match="below the smallest"):
        learn_ranks(model, batches, stats, blocks, choices, lowest - 1, steps=1, progress=False)


def test_learning_is_deterministic(calibrated):
    model, batches, stats, blocks, choices = calibrated
    runs = [learn_ranks(model, batches, stats, blocks, choices, 128, steps=10, progress=False, seed=3)
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_the_model_is_exactly_restored_after_learning_and_after_an_error(calibrated):
    model, batches, stats, blocks, choices = calibrated
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    model.model.norm.weight.requires_grad_(False)  # mixed requires_grad flags must come back as they were
    try:
        before = snapshot(model)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        learn_ranks(model, batches, stats, blocks, choices, 128, steps=6, progress=False)
        assert_untouched(model, before, ids, logits)

        calls = []

        def fail_later(module, args):  # the teacher passes and two training steps run, then the model fails
            calls.append(None)
            if len(calls) > len(batches) + 2:
                raise RuntimeError("injected failure")

        hook = model.lm_head.register_forward_pre_hook(fail_later)
        try:
            with pytest.raises(RuntimeError, match="injected failure"):
                learn_ranks(model, batches, stats, blocks, choices, 128, steps=6, progress=False)
        finally:
            hook.remove()
        assert len(calls) == len(batches) + 3
        assert_untouched(model, before, ids, logits)
    finally:
        model.model.norm.weight.requires_grad_(True)


def test_a_layer_whose_attention_is_multiplied_by_zero_gets_the_least_rank(dead_layer_model):
    """Layer DEAD's o_proj is zero, so its K and V cannot change the output: its distillation gradient is
    exactly zero and the rank penalty alone moves its thresholds. At half the full total rank, the learned
    ranks give both its sides the lowest allowed rank (no live layer's side gets less), and the KD loss of
    the learned ranks on the calibration rows is at most that of the uniform split of the same total
    (which wastes half the rank of the dead layer)."""
    model, batches, stats, blocks, choices = dead_layer_model
    total = sum(found[-1] for found in choices.values()) // 2
    ranks = learn_ranks(model, batches, stats, blocks, choices, total, progress=False)  # default steps
    assert sum(ranks.values()) <= total
    for side in ("k", "v"):
        assert ranks[DEAD, side] == choices[DEAD, side][0]
        assert all(ranks[layer, side] >= ranks[DEAD, side] for layer in range(LAYERS))
    uniform = {key: FULL // 2 for key in choices}
    assert sum(uniform.values()) == total and all(uniform[key] in choices[key] for key in choices)
    learned_loss, uniform_loss = (kd_loss(model, stats, blocks, found, batches) for found in (ranks, uniform))
    assert uniform_loss > 1e-3  # the budget costs something, so the comparison means something
    assert learned_loss <= uniform_loss


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_read_off_fits_any_total_and_leaves_no_affordable_step(data):
    """_read_off on arbitrary spectra and thresholds: allowed ranks, the sum within the total, and no side
    that could still step up within the rank left over."""
    count = data.draw(st.integers(1, 6))
    keys = [(index // 2, "kv"[index % 2]) for index in range(count)]
    blocks, choices, depth, theta = {}, {}, {}, {}
    for key in keys:
        blocks[key] = data.draw(st.sampled_from([1, 2, 4]))
        channels = data.draw(st.integers(2, 24))
        choices[key] = sorted(data.draw(st.sets(st.integers(1, channels), min_size=1, max_size=6)))
        choices[key] = [blocks[key] * rank for rank in choices[key]]
        gaps = data.draw(st.lists(st.floats(0.0, 1.0), min_size=channels, max_size=channels))
        cumulative = torch.tensor(gaps).cumsum(0)
        depth[key] = (cumulative - cumulative[0]) / max(float(cumulative[-1] - cumulative[0]), 1e-6)
        theta[key] = data.draw(st.floats(-0.5, 1.5))
    lowest = sum(found[0] for found in choices.values())
    total = lowest + data.draw(st.integers(0, sum(found[-1] for found in choices.values()) - lowest + 8))
    ranks = _read_off(keys, blocks, choices, depth, theta, total)
    assert all(ranks[key] in choices[key] for key in keys)
    assert sum(ranks.values()) <= total
    left = total - sum(ranks.values())
    assert all(rank == choices[key][-1] or choices[key][choices[key].index(rank) + 1] - rank > left
               for key, rank in ranks.items())
