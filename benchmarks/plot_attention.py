"""Where the decode kernel stands against issue 12's targets, as a picture: the rows of `benchmarks/attention.py`'s
result files that carry a target (contexts of 16K and more).

    python benchmarks/plot_attention.py RESULTS.json [MORE.json ...] --out docs/attention-h100.png

Later files replace earlier files' rows of the same shape, plan, batch and context (as the README's table takes the
newest run of each row). Left: each row's speedup over SDPA `enable_gqa` on the full cache against its byte ratio
(the full cache's bytes over those lrkv reads), with the line a kernel reading at SDPA's bandwidth would sit on and
the targets' lines (0.85x of it for 16-bit plans, 0.8x for quantized ones). Right: each row's speedup as a share of
its target, 1.0 meeting it. Prints one JSON line per plotted row.
"""
import argparse
import json
import pathlib

KEY = ("shape", "plan", "batch", "context")


def target_rows(paths):
    """The rows with a target, each (shape, plan, batch, context) from the last file that has it, sorted by shape, plan
    and context."""
    rows = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        if not isinstance(data, dict) or "rows" not in data:
            raise SystemExit(f"{path}: not a result file of benchmarks/attention.py (a JSON object with 'rows')")
        for row in data["rows"]:
            if row.get("target") and row.get("speedup"):
                rows[tuple(row[name] for name in KEY)] = dict(row, gpu=data.get("gpu"), source=str(path))
    if not rows:
        raise SystemExit("no row with a target in " + ", ".join(map(str, paths)) + " (targets start at 16K)")
    return [rows[key] for key in sorted(rows, key=lambda key: (key[0], key[1], key[3]))]


def plot(rows, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = sorted({row["plan"] for row in rows})
    colors = {plan: plt.get_cmap("tab10")(i) for i, plan in enumerate(plans)}
    markers = {"llama3-8b": "o", "llama2-7b": "s"}
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 6.5), gridspec_kw=dict(width_ratios=[1, 1.1]))
    top = max(row["bytes_ratio"] for row in rows) * 1.08
    left.plot([0, top], [0, top], color="black", lw=1, label="reads at SDPA's bandwidth")
    left.plot([0, top], [0, 0.85 * top], color="gray", ls="--", lw=1, label="target, 16-bit plans (0.85x)")
    left.plot([0, top], [0, 0.8 * top], color="gray", ls=":", lw=1, label="target, quantized plans (0.8x)")
    for row in rows:
        left.scatter(row["bytes_ratio"], row["speedup"], color=colors[row["plan"]],
                     marker=markers.get(row["shape"], "^"), s=60,
                     facecolors=colors[row["plan"]] if row["context"] < 65536 else "none")
    for plan in plans:
        left.scatter([], [], color=colors[plan], marker="o", label=plan)
    for shape, marker in markers.items():
        left.scatter([], [], color="black", marker=marker, label=shape)
    left.set(xlim=(0, top), ylim=(0, top), xlabel="byte ratio (full cache's bytes / bytes lrkv reads)",
             ylabel="speedup over SDPA enable_gqa, full cache",
             title="decode attention (filled: 16K, batch 16; hollow: 64K, batch 4)")
    left.legend(fontsize=8, loc="upper left")
    labels = [f"{row['shape']} {row['plan']}, {row['context'] // 1024}K" for row in rows]
    shares = [row["speedup"] / row["target"] for row in rows]
    bars = right.barh(range(len(rows)), shares, color=[colors[row["plan"]] for row in rows])
    for bar, row in zip(bars, rows):
        right.text(bar.get_width() + 0.01, bar.get_y() + bar.get_height() / 2,
                   f"{row['speedup']:.2f}x of {row['target']:.2f}x", va="center", fontsize=7)
    right.axvline(1.0, color="black", lw=1)
    right.set_yticks(range(len(rows)), labels, fontsize=7)
    right.invert_yaxis()
    right.set(xlim=(0, 1.25), xlabel="speedup / target (1.0: met)", title="share of issue 12's target")
    gpus = sorted({row["gpu"] for row in rows if row["gpu"]})
    figure.suptitle(", ".join(gpus))
    figure.tight_layout()
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="result files of benchmarks/attention.py, oldest first")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args()
    rows = target_rows(args.results)
    for row in rows:
        print(json.dumps({name: row[name] for name in (*KEY, "bytes_ratio", "speedup", "target", "source")}))
    plot(rows, args.out)


if __name__ == "__main__":
    main()
