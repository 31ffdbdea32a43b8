"""Command line: `lrkv explain` (what the matcher finds) and `lrkv ppl` (the perplexity table)."""
import argparse
import json


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
    ppl = commands.add_parser("ppl", help="perplexity of base vs compressed SmolLM2 per scheme and keep")
    ppl.add_argument("--keeps", type=float, nargs="+", default=[0.75, 0.5, 0.25])
    ppl.add_argument("--schemes", nargs="+", default=["head", "joint", "hybrid"])
    ppl.add_argument("--eval-rows", type=int, default=6)
    ppl.add_argument("--json", help="also write the figures to this JSON file")
    ppl.set_defaults(run=cmd_ppl)
    ppl.add_argument("--calib-rows", type=int, default=8, help="calibration rows of --length tokens")
    ppl.add_argument("--length", type=int, default=512)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
