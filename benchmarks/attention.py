"""Decode attention alone, on the GPU at hand: lrkv's Triton kernel over latent caches against
`F.scaled_dot_product_attention(..., enable_gqa=True)` over the full fp16 cache, with the device's copy bandwidth
measured in the same run. Llama-2-7B (32 x 128, MHA) and Llama-3-8B (32 query / 8 KV heads) attention shapes; one
layer; random orthonormal factors; caches written by the reference write op (the real layout).

    python benchmarks/attention.py [--sweep] [--only llama3-8b] [--extra-slots 17] [--rows] [--mask]
                                   [--out benchmarks/results]
    python benchmarks/attention.py --tiny [--sweep] [--mask]   # the logic on CPU under Triton's interpreter (times
                                                               # mean nothing)

Each row: shape, batch, context, keep, bits, lrkv_ms, sdpa_ms, speedup (sdpa_ms / lrkv_ms), bytes_ratio (bytes of
the full fp16 cache over the bytes lrkv reads: latents, scales and zero points, positions), lrkv_TBps (bytes lrkv
reads over its time), copy_TBps, rope_window (the "w1024" plans: windowed RoPE beyond 1024 tokens, whose far
slots score against their latents without rebuilding keys). The issue's target at context >= 16K: speedup >= 0.85 x bytes_ratio for 16-bit
plans, >= 0.8 x for the budget plan. --sweep first times launch geometries at 16K and uses the fastest per plan.
--extra-slots N adds N cached slots to every setting: the step sits at slot context - 1 with positions equal to
slots, so at the default contexts a window of 1024 has its edge on a tile boundary (no tile across it), where a
decode step meets such a tile in 63 of 64 positions; 17 puts the edge inside a tile. Quantized head-wise sides are
stored head-major where LatentCache stores them so (each KV head's codes in one run: `quantize.by_blocks`); --rows
stores them as rows (every KV head of a slot in one row), the layout before; each row's `storage` says which.
--mask passes lrkv's kernel the boolean mask [batch, 1, 1, slots] of a model's decode step (transformers builds one for
SDPA; here every slot kept, as in a batch without padding), each row's `mask` says whether; SDPA runs without one.
The file's name does not say which (nor --rows, nor --extra-slots): name a copy for the run.
Writes benchmarks/results/attention-<gpu>.json; never asserts timings. --tiny runs every plan at a tiny shape on CPU
under Triton's interpreter, each row checked against the reference op, windowed plans at a window that leaves far
tiles (TINY_WINDOW), and writes nothing.
"""
import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time

if "--tiny" in sys.argv:  # before Triton is imported: its kernels are interpreted from their definition on
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from lrkv_compile.lowering import reference  # noqa: E402
from lrkv_compile.lowering.quantize import by_blocks, exact_dtype, packed_width, stored_blocks  # noqa: E402
from lrkv_compile.lowering.triton_decode import CANDIDATES, decode_attention_with, launch_config  # noqa: E402

SHAPES = {"llama2-7b": dict(heads=32, kv_heads=32, head_dim=128), "llama3-8b": dict(heads=32, kv_heads=8, head_dim=128)}
SETTINGS = [(16, 4096), (16, 16384), (4, 65536)]
PLANS = [  # scheme, keep of K and V channels, bits, quantization group, exact sink tokens (, windowed RoPE)
    dict(plan="head keep 0.5", scheme="head", keep_k=0.5, keep_v=0.5, k_bits=16, v_bits=16, group=0, sinks=0),
    dict(plan="head keep 0.25", scheme="head", keep_k=0.25, keep_v=0.25, k_bits=16, v_bits=16, group=0, sinks=0),
    dict(plan="budget 0.2", scheme="head", keep_k=0.5, keep_v=1.0, k_bits=4, v_bits=3, group=32, sinks=4),
    dict(plan="head keep 0.5 w1024", scheme="head", keep_k=0.5, keep_v=0.5, k_bits=16, v_bits=16, group=0, sinks=0,
         rope_window=1024),
    dict(plan="head keep 0.25 w1024", scheme="head", keep_k=0.25, keep_v=0.25, k_bits=16, v_bits=16, group=0,
         sinks=0, rope_window=1024),
    dict(plan="budget 0.2 w1024", scheme="head", keep_k=0.5, keep_v=1.0, k_bits=4, v_bits=3, group=32, sinks=4,
         rope_window=1024),
    dict(plan="joint keep 0.5", scheme="joint", keep_k=0.5, keep_v=0.5, k_bits=16, v_bits=16, group=0, sinks=0),
    dict(plan="joint keep 0.25", scheme="joint", keep_k=0.25, keep_v=0.25, k_bits=16, v_bits=16, group=0, sinks=0),
]
TINY_SHAPE = dict(heads=4, kv_heads=2, head_dim=32)  # --tiny (and the prefill benchmark's)
TINY_SETTINGS = [(2, 200)]
TINY_WINDOW = 48  # --tiny's windowed RoPE: 1024 would leave no far slot in 200
JOINT_TFLOP_LIMIT = 5.0  # joint keys are rebuilt from every latent channel per KV head: skip rows beyond this


def _orthonormal_rows(rank, width, generator):
    q, _ = torch.linalg.qr(torch.randn(width, rank, generator=generator))
    return q.T.contiguous()  # [rank, width]


def factor(scheme, rank_per_head, kv_heads, head_dim, generator):
    if scheme == "head":
        return torch.block_diag(*[_orthonormal_rows(rank_per_head, head_dim, generator) for _ in range(kv_heads)])
    return _orthonormal_rows(rank_per_head * kv_heads, kv_heads * head_dim, generator)


def side_bytes(rank, bits, group):
    """Bytes one slot of one side occupies in the cache."""
    return 2 * rank if bits == 16 else packed_width(rank, bits) + 4 * (rank // group)


def build(shape, plan, batch, context, device, head_major=True, mask=False):
    """Keyword arguments of latent_attention for the decode step at slot context - 1, and the bytes it reads.
    head_major: quantized head-wise sides stored head-major where LatentCache stores them so (`quantize.by_blocks`),
    else as rows. mask: the boolean mask of a model's decode step, every slot kept; else none."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, head_dim, heads = shape["kv_heads"], shape["head_dim"], shape["heads"]
    rank_k, rank_v = (int(plan[f"keep_{side}"] * head_dim) * kv_heads for side in "kv")
    sides = {}
    for side, rank in (("k", rank_k), ("v", rank_v)):
        bits, group, sinks = plan[f"{side}_bits"], plan["group"], plan["sinks"]
        if bits == 16:
            empty = torch.zeros(0, dtype=torch.float16, device=device)
            sides[side] = [torch.randn(batch, context, rank, dtype=torch.float16, device=device), empty, empty.clone(),
                           empty.clone()]
        else:
            blocks = stored_blocks(bits, group, "token", 0, rank, kv_heads) if plan["scheme"] == "head" and head_major \
                else 1
            stored = [by_blocks(batch, context, width, blocks, dtype, device)
                      for width, dtype in ((packed_width(rank, bits), torch.uint8), (rank // group, torch.float16),
                                           (rank // group, torch.float16))]
            sides[side] = stored + [torch.zeros(batch, sinks, rank, dtype=exact_dtype(torch.float16), device=device)]
    positions = torch.arange(context, dtype=torch.int32, device=device).expand(batch, -1).contiguous()
    layout = dict(k_bits=plan["k_bits"], k_group=max(1, plan["group"]), k_sinks=plan["sinks"], k_axis="token",
                  k_outliers=0, v_bits=plan["v_bits"], v_group=max(1, plan["group"]), v_sinks=plan["sinks"],
                  v_axis="token", v_outliers=0)
    if plan["k_bits"] != 16 or plan["v_bits"] != 16:
        for begin in range(0, context, 2048):  # quantized as the cache writes them, a chunk at a time
            end = min(context, begin + 2048)
            new = {side: torch.randn(batch, end - begin, rank, dtype=torch.float16, device=device)
                   for side, rank in (("k", rank_k), ("v", rank_v))}
            reference.latent_write(*sides["k"], *sides["v"], positions, new["k"], new["v"],
                                   positions[:, begin:end].clone(),
                                   torch.tensor(begin), **layout)
        # the step's own latents contiguous, as the model's projection hands them over (a slice of the chunk would
        # cost the launcher a copy of each in the timed step: 6.5 us on an H100 at batch 16)
        new_k, new_v = new["k"][:, -1:].clone(), new["v"][:, -1:].clone()
    else:
        new_k, new_v = sides["k"][0][:, -1:].clone(), sides["v"][0][:, -1:].clone()
    rope = 1.0 / 500000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    kwargs = dict(
        query=torch.randn(batch, heads, 1, head_dim, dtype=torch.float16, device=device),
        latent_k=sides["k"][0], k_scale=sides["k"][1], k_zero=sides["k"][2], k_exact=sides["k"][3],
        latent_v=sides["v"][0], v_scale=sides["v"][1], v_zero=sides["v"][2], v_exact=sides["v"][3],
        positions=positions, new_k=new_k, new_v=new_v,
        up_k=factor(plan["scheme"], rank_k // kv_heads, kv_heads, head_dim, generator).to(device, torch.float16),
        bias_k=None,
        up_v=factor(plan["scheme"], rank_v // kv_heads, kv_heads, head_dim, generator).to(device, torch.float16),
        bias_v=None, inv_freq=rope, rope_scale=1.0, length=torch.tensor(context, device=device),
        attn_mask=torch.ones(batch, 1, 1, context, dtype=torch.bool, device=device) if mask else None,
        softmax_scale=head_dim ** -0.5, num_kv_heads=kv_heads, rope_window=plan.get("rope_window", 0), **layout)
    read = batch * context * (side_bytes(rank_k, plan["k_bits"], plan["group"])
                              + side_bytes(rank_v, plan["v_bits"], plan["group"]) + 4)
    return kwargs, read


def joint_tflop(shape, plan, batch, context):
    """Tensor-core work of rebuilding joint keys: every KV head from every latent channel, once per value chunk."""
    rank_k, rank_v = (int(plan[f"keep_{side}"] * shape["head_dim"]) * shape["kv_heads"] for side in "kv")
    return (batch * shape["kv_heads"] * math.ceil(rank_v / 128) * context * 2 * rank_k * shape["head_dim"]) / 1e12


def time_ms(fn, device=torch.device("cuda")):
    """Median milliseconds of fn on the GPU: replayed from a CUDA graph (launch overheads out, as a decode step
    captured in a graph runs), or timed launch by launch where capture fails; one call's on CPU."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except RuntimeError:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_tbps(device):
    """Device-to-device copy bandwidth, bytes read plus written: one 1 GiB copy, timed launch by launch (on CPU one
    copy of 64 MiB)."""
    source = torch.randn(1 << (29 if device.type == "cuda" else 25), dtype=torch.float16, device=device)
    target = torch.empty_like(source)
    if device.type != "cuda":
        return 2 * source.numel() * 2 / time_ms(lambda: target.copy_(source), device) / 1e9
    return 2 * source.numel() * 2 / do_bench(lambda: target.copy_(source), warmup=25, rep=100,
                                             return_mode="median") / 1e9


def sdpa_ms(shape, batch, context, device):
    query = torch.randn(batch, shape["heads"], 1, shape["head_dim"], dtype=torch.float16, device=device)
    keys, values = (torch.randn(batch, shape["kv_heads"], context, shape["head_dim"], dtype=torch.float16,
                                device=device) for _ in range(2))
    elapsed = time_ms(lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True), device)
    return elapsed, 2 * keys.numel() * 2


def compiled_resources():
    """Registers and spills of every compiled variant of the decode kernel (diagnostics; empty where this Triton
    keeps its cache elsewhere)."""
    from lrkv_compile.kernels import latent_decode
    found = []
    try:
        for caches in latent_decode.latent_decode_kernel.device_caches.values():
            for kernel in caches[0].values():
                found.append(dict(regs=kernel.n_regs, spills=kernel.n_spills, warps=kernel.metadata.num_warps,
                                  stages=kernel.metadata.num_stages, shared=kernel.metadata.shared))
    except (AttributeError, TypeError, IndexError):
        pass
    return found


def geometry_label(config) -> str:
    """A launch geometry in a few characters, as the sweep prints it and each row records it: slots per tile,
    warps, stages, register cap, and the options off their usual setting."""
    return (f"{config.block_s}/{config.num_warps}w/{config.num_stages}s/{config.max_registers}r"
            + ("/ahead" if config.positions_ahead else "") + ("" if config.across_both else "/across-by-edge-loop"))


def sweep(kwargs):
    """The launch geometries of `triton_decode.CANDIDATES` at this size, fastest first."""
    results = []
    for candidate in CANDIDATES:
        try:
            results.append((time_ms(lambda: decode_attention_with(candidate, **kwargs), kwargs["query"].device),
                            candidate))
        except Exception as error:  # a geometry the compiler rejects is reported, not fatal
            print(f"  {candidate}: {type(error).__name__}: {str(error)[:200]}")
    results.sort(key=lambda item: item[0])
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time launch geometries at 16K first")
    parser.add_argument("--only", nargs="*", default=list(SHAPES), help="shapes to run")
    parser.add_argument("--plans", nargs="*", default=[plan["plan"] for plan in PLANS])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU under Triton's interpreter")
    parser.add_argument("--extra-slots", type=int, default=0,
                        help="cached slots added to every setting (17: the window's edge inside a tile)")
    parser.add_argument("--rows", action="store_true",
                        help="quantized sides stored as rows, not head-major as LatentCache stores them")
    parser.add_argument("--mask", action="store_true",
                        help="lrkv's kernel gets the boolean mask of a model's decode step (every slot kept)")
    args = parser.parse_args()
    if args.extra_slots < 0:
        parser.error(f"--extra-slots {args.extra_slots}: a count of slots to add, 0 or more")
    plans = [plan for plan in PLANS if plan["plan"] in args.plans]
    if args.tiny:
        device, gpu, shapes, settings = torch.device("cpu"), "cpu", {"tiny": TINY_SHAPE}, TINY_SETTINGS
        plans = [{**plan, "rope_window": TINY_WINDOW} if plan.get("rope_window") else plan for plan in plans]
    else:
        device = torch.device("cuda")
        gpu = torch.cuda.get_device_name(device)
        shapes, settings = {name: SHAPES[name] for name in args.only}, SETTINGS
    settings = [(batch, context + args.extra_slots) for batch, context in settings]
    copy = copy_tbps(device)
    print(f"{gpu}: device-to-device copy {copy:.2f} TB/s")
    sweep_at = settings[0] if args.tiny else (16, 16384)
    chosen, sweeps = {}, []
    if args.sweep:
        for name, shape in shapes.items():
            for plan in plans:
                if plan["scheme"] != "head" or plan["plan"] == "head keep 0.5":
                    continue  # keep 0.5 takes keep 0.25's geometry
                kwargs, _ = build(shape, plan, *sweep_at, device, not args.rows, args.mask)
                results = sweep(kwargs)
                chosen[(name, plan["plan"])] = results[0][1]
                if plan["plan"] == "head keep 0.25":
                    chosen[(name, "head keep 0.5")] = results[0][1]
                print(f"sweep {name} {plan['plan']}: "
                      + ", ".join(f"{ms:.3f} ms {geometry_label(c)}" for ms, c in results[:6]))
                sweeps.append(dict(shape=name, plan=plan["plan"], results=[
                    dict(ms=ms, **dataclasses.asdict(c)) for ms, c in results]))
                del kwargs
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    rows, skipped = [], []
    for name, shape in shapes.items():
        for batch, context in settings:
            full_ms, full_bytes = sdpa_ms(shape, batch, context, device)
            for plan in plans:
                where = f"{name} batch {batch} context {context} {plan['plan']}"
                if plan["scheme"] == "joint" and joint_tflop(shape, plan, batch, context) > JOINT_TFLOP_LIMIT:
                    skipped.append(f"{where}: joint keys need {joint_tflop(shape, plan, batch, context):.0f} TFLOP "
                                   f"of rebuild (> {JOINT_TFLOP_LIMIT:g})")
                    continue
                free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else math.inf
                if full_bytes * 3 > free:
                    skipped.append(f"{where}: needs about {full_bytes * 3 / 2**30:.0f} GiB, {free / 2**30:.0f} free")
                    continue
                kwargs, read = build(shape, plan, batch, context, device, not args.rows, args.mask)
                quantized = plan["k_bits"] != 16 or plan["v_bits"] != 16
                config = chosen.get((name, plan["plan"])) or launch_config(**kwargs)  # what the launcher takes
                lrkv = time_ms(lambda: decode_attention_with(config, **kwargs), device)
                error = None
                if batch * context <= 16 * 4096:  # checked against the reference op where it fits
                    expected = reference.latent_attention(**kwargs).float()
                    actual = decode_attention_with(config, **kwargs).float()
                    error = float((actual - expected).norm() / expected.norm())
                    del expected, actual
                ratio = full_bytes / read
                factor_target = 0.8 if quantized else 0.85
                rows.append(dict(
                    shape=name, batch=batch, context=context, plan=plan["plan"], scheme=plan["scheme"],
                    keep=f"{plan['keep_k']:g}/{plan['keep_v']:g}", bits=f"{plan['k_bits']}/{plan['v_bits']}",
                    rope_window=plan.get("rope_window", 0),
                    storage="blocks" if kwargs["latent_k"].dim() == 4 or kwargs["latent_v"].dim() == 4 else "rows",
                    mask=args.mask,
                    lrkv_ms=round(lrkv, 4), sdpa_ms=round(full_ms, 4), speedup=round(full_ms / lrkv, 3),
                    bytes_ratio=round(ratio, 3), lrkv_TBps=round(read / lrkv / 1e9, 3),
                    sdpa_TBps=round(full_bytes / full_ms / 1e9, 3), copy_TBps=round(copy, 3),
                    target=round(factor_target * ratio, 3) if context >= 16384 and plan["scheme"] == "head" else None,
                    relative_error=error, config=dataclasses.asdict(config), geometry=geometry_label(config)))
                if args.tiny:
                    print(json.dumps(rows[-1]), flush=True)
                else:  # rewritten after every row, so an interrupted run keeps what it measured
                    write(args.out, gpu, copy, rows, skipped, sweeps)
                    print(" ".join(f"{k}={v}" for k, v in rows[-1].items() if k != "config"), flush=True)
                del kwargs
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(f"\n{'shape':10} {'batch':>5} {'context':>7} {'plan':16} {'bits':6} {'lrkv_ms':>8} {'sdpa_ms':>8} "
          f"{'speedup':>7} {'bytes_ratio':>11} {'target':>6} {'lrkv_TBps':>9} {'copy_TBps':>9}")
    for row in rows:
        target = f"{row['target']:.2f}" if row["target"] is not None else "-"
        print(f"{row['shape']:10} {row['batch']:>5} {row['context']:>7} {row['plan']:16} {row['bits']:6} "
              f"{row['lrkv_ms']:>8.3f} {row['sdpa_ms']:>8.3f} {row['speedup']:>7.2f} {row['bytes_ratio']:>11.2f} "
              f"{target:>6} {row['lrkv_TBps']:>9.2f} {row['copy_TBps']:>9.2f}")
    for line in skipped:
        print("skipped:", line)
    if not args.tiny:
        print(f"wrote {write(args.out, gpu, copy, rows, skipped, sweeps)}")


def results_path(folder, benchmark, gpu):
    """The file a benchmark writes its rows to on this GPU: <folder>/<benchmark>-<gpu name as a slug>.json."""
    return pathlib.Path(folder) / f"{benchmark}-{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}.json"


def write(folder, gpu, copy, rows, skipped, sweeps):
    """The JSON results so far (rewritten after every row, so an interrupted run keeps what it measured)."""
    path = results_path(folder, "attention", gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(gpu=gpu, torch=torch.__version__, copy_TBps=copy, rows=rows, skipped=skipped,
                                    sweeps=sweeps, kernels=compiled_resources()), indent=1))
    return path


if __name__ == "__main__":
    main()
