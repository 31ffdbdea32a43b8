"""The main job: calibrate a rank plan on real text, compile SmolLM2 with lrkv, generate through a latent cache.

    python examples/compress_and_generate.py [--keep 0.5] [--scheme joint] [--new-tokens 64]
"""
import argparse
import time

import torch

import lrkv_compile as lrkv
from lrkv_compile.models import load_smollm2, python_docs_text, token_batches

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--keep", type=float, default=0.5, help="fraction of the K/V cache kept")
parser.add_argument("--scheme", default="joint", choices=["joint", "head", "group", "hybrid"])
parser.add_argument("--prompt", default="The history of the printing press begins")
parser.add_argument("--new-tokens", type=int, default=64)
parser.add_argument("--plan", default="plan.safetensors", help="where the plan is saved")
args = parser.parse_args()

model, tokenizer = load_smollm2()
calibration_text, _ = python_docs_text()
batches = token_batches(tokenizer, calibration_text, count=8, length=512)

plan = lrkv.calibrate(model, batches, keep=args.keep, scheme=args.scheme)
plan.save(args.plan)
plan = lrkv.RankPlan.load(args.plan)
print(plan.summary(), f"-> saved to {args.plan}")
lrkv.explain(model, plan)

reference = lrkv.low_rank_reference(model, plan)  # eager model with the same factors, for comparison
ids = tokenizer(args.prompt, return_tensors="pt").input_ids
model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
cache = lrkv.LatentCache(model, plan, max_batch_size=1, max_cache_len=ids.shape[1] + args.new_tokens)
start = time.perf_counter()
with torch.no_grad():
    out = model.generate(ids, past_key_values=cache, max_new_tokens=args.new_tokens, do_sample=False)
elapsed = time.perf_counter() - start
with torch.no_grad():
    expected = reference.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)

print(f"\nprompt: {args.prompt!r}")
print(f"lrkv keep={args.keep} ({args.scheme}): {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")
print(f"cache: {cache.nbytes():,} bytes, a full cache of the same capacity and dtype: {cache.full_cache_nbytes():,} "
      f"(ratio {cache.nbytes() / cache.full_cache_nbytes():.3f})")
print(f"generation with compilation: {elapsed:.1f} s")
same = bool(torch.equal(out, expected))
print(f"greedy tokens equal the eager low-rank reference: {same}")
if not same:
    raise SystemExit("lrkv's tokens differ from the eager low-rank reference")
