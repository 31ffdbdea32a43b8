"""Decode steps on the CPU: SmolLM2-135M from its wheel, uncompressed (transformers' DynamicCache, eager) against lrkv
compiled under the committed budget-0.2 plan (`examples/plans/smollm2-budget-0.2.safetensors`), whose latent ops run
the reference implementation on the CPU (`lowering/reference.py`). Each context: a random prompt of that many tokens
is prefilled, then one-token steps are timed at the same slot (the cache's length put back before each step; three
untimed steps first).

    python benchmarks/cpu_decode.py [--contexts 512 2048] [--steps 5] [--threads 2] [--out benchmarks/results]
    python benchmarks/cpu_decode.py --tiny    # a small random model and a uniform plan: checks the script

Rows: path, context, ms_per_step (the median), tokens_per_s, threads. Writes benchmarks/results/cpu-decode.json
(not with --tiny); never asserts timings.
"""
import argparse
import json
import pathlib

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import lrkv_compile as lrkv
from generate import time_steps  # benchmarks/generate.py, beside this script
from lrkv_compile.compiled import cache_capacity

PLAN = pathlib.Path(__file__).parent.parent / "examples" / "plans" / "smollm2-budget-0.2.safetensors"


def decoding(model, cache, token, keyword):
    """One decode step of `model` through `cache`, as `generate.time_steps` times it."""
    def step():
        with torch.no_grad():
            model(input_ids=token, **{keyword: cache}, use_cache=True)
    return step


def stock_row(model, ids, steps, keyword) -> float:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        token = model(input_ids=ids, **{keyword: cache}, use_cache=True).logits[:, -1:].argmax(-1)
    context = ids.shape[1]

    def rewind():  # a negative count removes that many tokens (transformers 5.24 refuses a length)
        extra = cache.get_seq_length() - context
        if extra:
            cache.crop(-extra)
    return time_steps(decoding(model, cache, token, keyword), steps, ids.device, rewind)[1]


def lrkv_row(compiled, model, plan, ids, steps, keyword, capacity) -> float:
    cache = lrkv.LatentCache(model, plan, max_batch_size=1, max_cache_len=capacity)
    with torch.no_grad():
        token = compiled(input_ids=ids, **{keyword: cache}, use_cache=True).logits[:, -1:].argmax(-1)
    lengths = [layer.cumulative_length for layer in cache.layers]
    prefilled = [length.clone() for length in lengths]
    return time_steps(decoding(compiled, cache, token, keyword), steps, ids.device,
                      lambda: torch._foreach_copy_(lengths, prefilled))[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    parser.add_argument("--tiny", action="store_true", help="a small random model and a uniform plan")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.tiny:
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, num_hidden_layers=2, vocab_size=256)
        model = LlamaForCausalLM(config).eval()
        plan = lrkv.RankPlan.uniform(model, keep=0.5)
        contexts, name = [16, 40], "tiny random Llama"
    else:
        from lrkv_compile.models import load_smollm2
        model, _ = load_smollm2()
        plan, contexts, name = lrkv.RankPlan.load(PLAN), args.contexts, "SmolLM2-135M"
    keyword = lrkv.cache_keyword(model)
    compiled = lrkv.compile(model, plan)
    capacity = cache_capacity(max(contexts) + 1)  # one capacity: one decode graph for every context
    rows = []
    for context in contexts:
        ids = torch.randint(0, model.config.vocab_size, (1, context))
        for path, seconds in ((f"{name}, DynamicCache, eager", stock_row(model, ids, args.steps, keyword)),
                              (f"{name}, lrkv, plan of budget {plan.budget:.2f}",
                               lrkv_row(compiled, model, plan, ids, args.steps, keyword, capacity))):
            row = dict(path=path, context=context, ms_per_step=round(seconds * 1e3, 1),
                       tokens_per_s=round(1 / seconds, 2), threads=args.threads)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if not args.tiny:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu-decode.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
