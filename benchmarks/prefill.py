"""Prefill and chunked prefill attention alone, on the GPU at hand: lrkv's prefill (a chunk of new tokens against the
latent cache of the earlier ones and their own exact latents), on each of its two paths (the flash-style Triton
kernel, and the rebuild path: keys and value latents rebuilt into dense buffers, then SDPA), against
`F.scaled_dot_product_attention(..., enable_gqa=True)` over the full fp16 keys and values of the same slots, one
layer, Llama-2-7B and Llama-3-8B attention shapes, the plans of `attention.py`.

    python benchmarks/prefill.py [--only llama3-8b] [--plans "budget 0.2"] [--out benchmarks/results]
    python benchmarks/prefill.py --tiny   # the logic on CPU under Triton's interpreter (times mean nothing there)

A setting is (batch, cached prefix, new tokens): a whole 4K prompt, the last 2K chunk of a 16K one, and short chunks
at the end of a 16K context (where the launcher's choice of path turns). SDPA gets
what transformers' SDPA path passes for a chunk: a boolean mask [tokens, prefix + tokens] where there is a prefix
(its memory-efficient kernel), `is_causal` where there is none (flash). Each row: shape, batch, prefix, tokens,
plan, path (the one the launcher picks), kernel_ms and rebuild_ms (each path forced; None where the rebuild path does
not take the plan), lrkv_ms (the picked path's), sdpa_ms, speedup (sdpa_ms / lrkv_ms), and the peak memory each call
allocates beyond its inputs (lrkv_extra_MiB for the picked path, sdpa_extra_MiB), with the picked path's error
against the reference op where that fits in memory. Writes
benchmarks/results/prefill-<gpu>.json; never asserts timings.
"""
import argparse
import json
import os
import pathlib
import sys

if "--tiny" in sys.argv:  # before Triton is imported: its kernels are interpreted from their definition on
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import attention  # noqa: E402  (the shapes, plans and cache builder of the decode benchmark)

from lrkv_compile.lowering import reference  # noqa: E402
from lrkv_compile.lowering.triton_prefill import choose_path, prefill_attention_with  # noqa: E402

# batch, cached prefix, new tokens
SETTINGS = [(1, 0, 4096), (1, 14336, 2048), (4, 14336, 2048), (1, 16320, 64), (4, 16320, 64), (1, 16128, 256),
            (1, 15872, 512), (1, 15360, 1024)]
PLANS = ["head keep 0.5", "head keep 0.25", "budget 0.2", "budget 0.2 w1024"]
TINY_SETTINGS = [(1, 0, 24), (2, 40, 9)]  # both paths are timed (forced) whatever the launcher picks


def build(shape, plan, batch, prefix, tokens, device):
    """Keyword arguments of latent_attention for `tokens` new tokens after `prefix` cached slots (the cache written
    by the reference write op, the real layout) and the full fp16 queries, keys and values of the same slots."""
    kwargs, _ = attention.build(shape, plan, batch, prefix + tokens, device)
    generator = torch.Generator(device="cpu").manual_seed(1)
    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    kwargs["query"] = torch.randn(batch, heads, tokens, head_dim, generator=generator).to(device, torch.float16)
    for side in "kv":  # this step's exact latents: the last `tokens` slots' (16-bit caches hold them as they are)
        rank = kwargs[f"new_{side}"].shape[-1]
        if kwargs[f"{side}_bits"] == 16:
            kwargs[f"new_{side}"] = kwargs[f"latent_{side}"][:, prefix:].clone()
        else:
            kwargs[f"new_{side}"] = torch.randn(batch, tokens, rank, generator=generator).to(device, torch.float16)
    full = [torch.randn(batch, kv_heads, prefix + tokens, head_dim, generator=generator).to(device, torch.float16)
            for _ in range(2)]
    return kwargs, full


def sdpa(query, keys, values, prefix):
    """What transformers' SDPA path runs for a chunk after `prefix` cached slots."""
    if prefix == 0:
        return F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
    tokens, slots = query.shape[2], keys.shape[2]
    slot, token = torch.arange(slots, device=query.device), torch.arange(tokens, device=query.device)
    mask = slot[None, :] <= prefix + token[:, None]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)


def measure(fn, device):
    """(median ms, MiB allocated at the peak beyond what was allocated before the call; None on CPU, where it is not
    measured)."""
    if device.type != "cuda":
        return attention.time_ms(fn, device), None
    fn()
    from triton.testing import do_bench
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    extra = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return do_bench(fn, warmup=10, rep=50, return_mode="median"), extra


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=list(attention.SHAPES), help="shapes to run")
    parser.add_argument("--plans", nargs="*", default=PLANS)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU under Triton's interpreter")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()
    plans = [plan for plan in attention.PLANS if plan["plan"] in args.plans]
    if args.tiny:
        device, gpu, shapes, settings = torch.device("cpu"), "cpu", {"tiny": attention.TINY_SHAPE}, TINY_SETTINGS
    else:
        device = torch.device("cuda")
        gpu = torch.cuda.get_device_name(device)
        shapes, settings = {name: attention.SHAPES[name] for name in args.only}, SETTINGS
    rows = []
    for name, shape in shapes.items():
        for batch, prefix, tokens in settings:
            for plan in plans:
                kwargs, (keys, values) = build(shape, plan, batch, prefix, tokens, device)
                path = choose_path(kwargs["query"], kwargs["attn_mask"], kwargs["rope_window"], kwargs["k_bits"],
                                   kwargs["v_bits"])
                times = {}
                for forced in ("kernel", "rebuild"):
                    try:
                        times[forced] = measure(lambda: prefill_attention_with(forced, **kwargs), device)
                    except NotImplementedError:  # a step the rebuild path does not take (`rebuild_refusal`)
                        times[forced] = (None, None)
                lrkv_ms, lrkv_extra = times[path]
                sdpa_ms, sdpa_extra = measure(lambda: sdpa(kwargs["query"], keys, values, prefix), device)
                error = None
                if batch * (prefix + tokens) * tokens <= 4096 * 4096:  # against the reference op where it fits
                    expected = reference.latent_attention(**kwargs).float()
                    error = float((prefill_attention_with(path, **kwargs).float() - expected).norm() / expected.norm())
                rows.append(dict(shape=name, batch=batch, prefix=prefix, tokens=tokens, plan=plan["plan"],
                                 bits=f"{plan['k_bits']}/{plan['v_bits']}", path=path,
                                 kernel_ms=round(times["kernel"][0], 3),
                                 rebuild_ms=times["rebuild"][0] and round(times["rebuild"][0], 3),
                                 lrkv_ms=round(lrkv_ms, 3), sdpa_ms=round(sdpa_ms, 3),
                                 speedup=round(sdpa_ms / lrkv_ms, 3),
                                 lrkv_extra_MiB=lrkv_extra and round(lrkv_extra, 1),
                                 sdpa_extra_MiB=sdpa_extra and round(sdpa_extra, 1), relative_error=error))
                print(json.dumps(rows[-1]), flush=True)
                if not args.tiny:  # rewritten after every row, so an interrupted run keeps what it measured
                    write(args.out, gpu, rows)
                del kwargs, keys, values
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(f"\n{'shape':10} {'batch':>5} {'prefix':>6} {'tokens':>6} {'plan':18} {'path':8} {'kernel':>8} "
          f"{'rebuild':>8} {'sdpa_ms':>8} {'speedup':>7} {'lrkv_MiB':>8} {'sdpa_MiB':>8}")
    for row in rows:
        print(f"{row['shape']:10} {row['batch']:>5} {row['prefix']:>6} {row['tokens']:>6} {row['plan']:18} "
              f"{row['path']:8} {row['kernel_ms']:>8.3f} {str(row['rebuild_ms']):>8} {row['sdpa_ms']:>8.3f} "
              f"{row['speedup']:>7.2f} {str(row['lrkv_extra_MiB']):>8} {str(row['sdpa_extra_MiB']):>8}")
    if not args.tiny:
        print(f"wrote {write(args.out, gpu, rows)}")


def write(folder, gpu, rows):
    path = attention.results_path(folder, "prefill", gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(gpu=gpu, torch=torch.__version__, rows=rows), indent=1))
    return path


if __name__ == "__main__":
    main()
