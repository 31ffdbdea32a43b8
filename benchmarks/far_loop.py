"""Times the budget-0.2 plan's Gluon far loop (`lowering/gluon_far.py`) on a GPU beside the Triton decode kernel.

Llama-3-8B shape (8 KV heads of 4 query heads), batch 16, 16K slots, the cache `attention.py` builds for the
budget 0.2 w1024 plan. The far loop reads every slot as a far one (the decode kernel's window of 1024 near slots is
not its work), so its time is a floor for that plan's kernel, not the kernel: prints milliseconds and TB/s per split
count, the Triton kernel's whole step, the device's copy bandwidth, and writes benchmarks/results/far-loop-<gpu>.json.
Each split count is timed over the cache's row layout (every KV head of a slot in one row) and over a head-major copy
of the same bytes (each KV head's slots in one run, as views [rows, slots, kv_heads, per KV head]), the same kernel
with other strides: head-major is how `LatentCache` stores this layout (docs/gpu-notes.md).
"""
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import attention as bench  # noqa: E402
from lrkv_compile.lowering.gluon_far import combine, far_partials, head_major  # noqa: E402

SPLITS = (8, 12, 14, 16, 24, 32)


def main():
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    batch, context, kv_heads = 16, 16384, 8
    plan = next(plan for plan in bench.PLANS if plan["plan"] == "budget 0.2 w1024")
    kwargs, read = bench.build(bench.SHAPES["llama3-8b"], plan, batch, context, device, head_major=False)
    cache = [kwargs[name] for name in ("latent_k", "k_scale", "k_zero", "latent_v", "v_scale", "v_zero")]
    layouts = dict(row=cache, head_major=[head_major(tensor, kv_heads) for tensor in cache])
    query = (torch.randn(batch, kv_heads, 4, 64, device=device) * 0.2).half()
    copy = bench.copy_tbps(device)
    rows = []
    for splits in SPLITS:
        for layout, sides in layouts.items():
            combine(*far_partials(*sides, query, splits))  # compiles
            ms = bench.time_ms(lambda: far_partials(*sides, query, splits))
            rows.append(dict(splits=splits, layout=layout, far_loop_ms=ms, far_loop_TBps=read / ms / 1e9))
            print(f"far loop, {splits:2} splits, {layout:10}: {ms:.4f} ms, {read / ms / 1e9:.2f} TB/s")
    config = bench.launch_config(**kwargs)
    triton_ms = bench.time_ms(lambda: bench.decode_attention_with(config, **kwargs))
    print(f"Triton decode kernel, whole step: {triton_ms:.4f} ms; bytes read {read / 1e6:.1f} MB; "
          f"copy {copy:.2f} TB/s ({gpu})")
    out = bench.results_path(pathlib.Path(__file__).parent / "results", "far-loop", gpu)
    out.write_text(json.dumps(dict(gpu=gpu, batch=batch, context=context, bytes=read, copy_TBps=copy,
                                   triton_kernel_ms=triton_ms, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
