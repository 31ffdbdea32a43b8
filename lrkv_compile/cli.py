"""Command line: `lrkv explain`, `lrkv generate` (the main job), `lrkv ppl` (the perplexity table)."""
import argparse
import json
import time

import torch


def _data(tokenizer, calib_rows, eval_rows, length):
    from .models import python_docs_text, token_batches
    calibration_text, evaluation_text = python_docs_text()
    return (token_batches(tokenizer, calibration_text, calib_rows, length),
            token_batches(tokenizer, evaluation_text, eval_rows, length))


def cmd_explain(args):
    from . import RankPlan, explain
    from .models import load_smollm2
    model, _ = load_smollm2()
    explain(model, RankPlan.load(args.plan) if args.plan else None)


def cmd_generate(args):
    import lrkv_compile as lrkv
    from .models import load_smollm2
    model, tokenizer = load_smollm2()
    calibration, _ = _data(tokenizer, args.calib_rows, 1, args.length)
    plan = lrkv.calibrate(model, calibration, keep=args.keep, scheme=args.scheme)
    plan.save(args.plan)
    plan = lrkv.RankPlan.load(args.plan)
    print(plan.summary(), f"-> saved to {args.plan}")
    reference = lrkv.low_rank_reference(model, plan)
    prompt = tokenizer(args.prompt, return_tensors="pt").input_ids
    model.forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan})
    cache = lrkv.LatentCache(model, plan, max_batch_size=1, max_cache_len=prompt.shape[1] + args.new_tokens)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=args.new_tokens, do_sample=False)
        expected = reference.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    text = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
    ratio = cache.nbytes() / cache.full_cache_nbytes()
    print(f"\nprompt: {args.prompt!r}\nlrkv (keep={args.keep}, {args.scheme}): {text!r}")
    print(f"cache: {cache.nbytes()} bytes vs {cache.full_cache_nbytes()} for a full cache (ratio {ratio:.3f})")
    same = out.shape == expected.shape and bool((out == expected).all())
    print(f"greedy tokens equal the eager low-rank reference: {same}  ({elapsed:.1f} s for both generations)")
    if not same:
        raise SystemExit("lrkv output differs from the eager low-rank reference")


def cmd_ppl(args):
    import lrkv_compile as lrkv
    from rich.console import Console
    from rich.table import Table
    from .calibrate import collect_grams
    from .evaluate import compiled_forward, perplexity
    from .models import load_smollm2
    model, tokenizer = load_smollm2()
    calibration, evaluation = _data(tokenizer, args.calib_rows, args.eval_rows, args.length)
    results = {"base": perplexity(model.forward, evaluation)}
    grams = collect_grams(model, calibration)
    for scheme in args.schemes:
        for keep in args.keeps:
            plan = lrkv.calibrate(model, calibration, keep=keep, scheme=scheme, grams=grams, progress=False)
            results[f"{scheme} keep={keep}"] = perplexity(compiled_forward(model, plan), evaluation)
    table = Table(title=f"SmolLM2-135M perplexity, {args.eval_rows}x{args.length} tokens of Python docs prose")
    table.add_column("K/V scheme")
    for keep in args.keeps:
        table.add_column(f"keep {keep}")
    table.add_row("base (no compression)", *[f"{results['base']:.2f}"] * len(args.keeps))
    for scheme in args.schemes:
        table.add_row(scheme, *(f"{results[f'{scheme} keep={keep}']:.2f}" for keep in args.keeps))
    Console().print(table)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="lrkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    explain_parser = commands.add_parser("explain", help="attention sites SmolLM2's graph has, and a plan's choices")
    explain_parser.add_argument("--plan", help="a saved plan file")
    explain_parser.set_defaults(run=cmd_explain)
    generate = commands.add_parser("generate", help="calibrate SmolLM2, compile it with lrkv and generate")
    generate.add_argument("--keep", type=float, default=0.5)
    generate.add_argument("--scheme", default="joint", choices=["joint", "head", "group", "hybrid"])
    generate.add_argument("--prompt", default="The history of the printing press begins")
    generate.add_argument("--new-tokens", type=int, default=64)
    generate.add_argument("--plan", default="plan.safetensors")
    generate.set_defaults(run=cmd_generate)
    ppl = commands.add_parser("ppl", help="perplexity of base vs compressed SmolLM2 per scheme and keep")
    ppl.add_argument("--keeps", type=float, nargs="+", default=[0.75, 0.5, 0.25])
    ppl.add_argument("--schemes", nargs="+", default=["head", "joint", "hybrid"])
    ppl.add_argument("--eval-rows", type=int, default=6)
    ppl.add_argument("--json", help="also write the figures to this JSON file")
    ppl.set_defaults(run=cmd_ppl)
    for sub in (generate, ppl):
        sub.add_argument("--calib-rows", type=int, default=8, help="calibration rows of --length tokens")
        sub.add_argument("--length", type=int, default=512)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
