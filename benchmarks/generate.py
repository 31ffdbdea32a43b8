"""Greedy decode steps of a whole model on the GPU at hand: lrkv (its compiled graph, Triton decode kernel under
Inductor) against transformers' StaticCache (its own SDPA path, eager and compiled with reduce-overhead) and the
same StaticCache under an attention function that calls SDPA with enable_gqa=True (the fair baseline: the stock
path copies K/V per query head), and transformers' QuantizedCache int4 (quanto backend, groups of 64 as `lrkv eval`
uses, its default residual window of 128 tokens; eager, transformers' SDPA). Random-weight Llama-3-8B-shaped model
(32 layers, 32 query / 8 KV heads, head_dim 128, fp16); the caches are filled with random content up to the context
(prefill is not timed here), then decode steps are timed.

QuantizedCache has no buffers to fill in place: random keys and values go through its own `update`, as a prompt's
and then decoded tokens' would, so that the quantized part holds all but the last `min(64, (context - 1) // 2)`
tokens and the full-precision residual holds those (halfway through its window, which is quantized into the rest
whenever it fills). Every timed step sets the residual back, dequantizes the whole cache and appends one token to
the residual; the requantization of the whole cache that the window's filling brings once every 128 steps is not
timed.

    python benchmarks/generate.py [--context 16384] [--batch 16] [--layers 32] [--steps 20] [--out benchmarks/results]
    python benchmarks/generate.py --tiny      # a small model on CPU: checks the script, times nothing useful
    python benchmarks/generate.py --only "budget" --profile   # some paths, with their most expensive kernels
    python benchmarks/generate.py --alternate --only "RoPE window 1024, reduce-overhead" "enable_gqa, compiled"

lrkv's paths run each plan twice: compiled as lrkv.compile does by default, and with mode="reduce-overhead".

Rows: path, batch, context, ms_per_step, tokens_per_s, cache_GiB, peak_GiB (torch.cuda.max_memory_allocated over
the timed steps), compile_s (the first step's time less a timed step's, for compiled paths), kernel_calls_per_step
(Python-level calls of the Triton decode path per timed step: one per layer where lrkv's "auto" picked it and no
CUDA graph replays the step; under reduce-overhead only the warm-up and recording passes count), and max_batch:
the largest batch the device's memory would hold at this context, from the measured peak (weights and working set)
and the cache's bytes per sequence (an estimate, not a run: --batch runs one). QuantizedCache's cache_GiB is read
from the cache after a step: the storage of its quantized tensors (packed codes, scales, zero points) and its
residual. A path that cannot
run (QuantizedCache without optimum-quanto, say) is a row with its `error`. Writes
benchmarks/results/generate-<gpu>.json after each row (--only replaces those paths' rows and keeps the others);
never asserts timings.

--alternate sets up every wanted path first and then times them in turns, one step of each a round (each first
called, compiling where it compiles, and warmed up in turn), so that their ratios come from one process at one time: on
an H100 the same path's step moved by up to 10% between processes of one machine, more than a change under test
(docs/gpu-notes.md, stop 71). It needs --only (one or more texts), for paths whose caches fit the device together (one
StaticCache at 16K and batch 16 is 32 GiB: two of them and the weights do not fit an H100). Its rows say `alternated`
and leave out peak_GiB, max_batch and kernel_calls_per_step (every path's cache is held at once): take those from a
run without it. They add enqueue_ms, the host's time until a step's call returns (a CUDA graph's replay included),
and back_to_back_ms, a step's time in bursts of steps with no synchronize between them (where the host keeps ahead,
the device's time a step, its rewind's one launch included), so that a step's time splits into the host's and the
device's. They go to benchmarks/results/generate-alternate-<gpu>.json, once every round has run; a path that fails
its first calls is a row with its `error`, and the others still run.
"""
import argparse
import dataclasses
import gc
import json
import pathlib
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, QuantizedCache, StaticCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

import attention  # the results file's name (benchmarks/attention.py, beside this script)
import lrkv_compile as lrkv
from lrkv_compile.lowering import triton_decode

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=512)


def sdpa_gqa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: SDPA with enable_gqa=True, no K/V copy per query head."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("sdpa_gqa", sdpa_gqa)
ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa_gqa", sdpa_mask)

kernel_calls = []  # one entry per call of the Triton decode path: shows that "auto" chose the kernel
_launch = triton_decode.decode_attention
triton_decode.decode_attention = lambda **kwargs: kernel_calls.append(1) or _launch(**kwargs)


def build_model(shape, layers, device, dtype):
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=1 << 20, **shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy of the weights
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def fill_latent(cache, context):
    """Random latents (random codes, small scales) in every slot before `context - 1`, positions 0.."""
    generator = torch.Generator(device=cache.positions.device).manual_seed(1)
    cache.positions.copy_(torch.arange(cache.max_cache_len, dtype=torch.int32, device=cache.positions.device))
    for layer in cache.layers:
        for tensor in layer.tensors():
            if tensor.dtype == torch.uint8:
                tensor.copy_(torch.randint(0, 256, tensor.shape, generator=generator, device=tensor.device,
                                           dtype=torch.uint8))
            elif tensor.is_floating_point() and tensor.numel():
                tensor.copy_(torch.rand(tensor.shape, generator=generator, device=tensor.device) * 0.02)
        layer.cumulative_length.fill_(context - 1)


def fill_static(model, cache, batch, context):
    """A one-token prefill initialises the StaticCache's buffers; then random keys and values fill them, and its
    layers' lengths say `context - 1` tokens (a StaticLayer of the transformers pyproject accepts writes at its
    `cumulative_length` and moves it on, whatever cache_position the step passes)."""
    with torch.no_grad():
        model(input_ids=torch.zeros(batch, 1, dtype=torch.long, device=model.device),
              **{lrkv.cache_keyword(model): cache}, use_cache=True)
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            tensor.normal_(0, 1)
        layer.cumulative_length.fill_(context - 1)


def rewinder(cache, context):
    """A call that puts every layer's length (`cumulative_length`, LatentCache's and StaticCache's) back to
    `context - 1` tokens in one launch, so that each timed step writes the same slot and attends over `context`
    tokens."""
    lengths = [layer.cumulative_length for layer in cache.layers]
    before = torch.tensor(context - 1, device=lengths[0].device)

    def rewind():
        torch._foreach_copy_(lengths, [before] * len(lengths))
    return rewind


def fill_quantized(model, cache, batch, context):
    """Random keys and values of `context - 1` tokens through the QuantizedCache's own `update`: all but the last
    `residual` as one prompt (which it quantizes), then those as decoded tokens (which its residual holds)."""
    residual = min(cache.layers[0].residual_length // 2, (context - 1) // 2)
    config = model.config
    generator = torch.Generator(device=model.device).manual_seed(1)
    for index in range(len(cache.layers)):
        for length in (context - 1 - residual, residual):
            keys, values = (torch.randn(batch, config.num_key_value_heads, length, config.head_dim,
                                        generator=generator, device=model.device, dtype=model.dtype)
                            for _ in range(2))
            cache.update(keys, values, index)


def held_bytes(tensors):
    """Bytes of the storages under `tensors`, each counted once; quanto's quantized tensors are opened down to their
    plain tensors (packed codes, scales, zero points)."""
    storages = {}

    def visit(tensor):
        if hasattr(tensor, "__tensor_flatten__"):
            for name in tensor.__tensor_flatten__()[0]:
                visit(getattr(tensor, name))
        else:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    for tensor in tensors:
        visit(tensor)
    return sum(storages.values())


WARMUP_STEPS = 6  # untimed calls after the first: an lrkv step's replays settle over about five (below)


def timed_call(step, rewind, device):
    """Seconds of one call of `step`, after `rewind` (outside its time), synchronized around it on a GPU."""
    return split_call(step, rewind, device)[1]


def split_call(step, rewind, device):
    """(seconds until `step` returns, seconds until the device is done too) of one call after `rewind` (outside its
    time), synchronized before it: the host's share of a step (Dynamo's guards, the launches or a CUDA graph's
    replay) and the whole step."""
    rewind()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    returned = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return returned - start, time.perf_counter() - start


def back_to_back(step, rewind, device, steps):
    """Seconds a step of `steps` calls in a row (each after its `rewind`, whose one launch it counts), synchronized
    only before the first and after the last: the host enqueues a step while the device runs the one before, so where
    the host keeps ahead this is the device's time a step and its rewind (a decode loop that keeps its tokens on the
    device, no check per step)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        rewind()
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def time_steps(step, steps, device, rewind):
    """(seconds of the first call, median seconds of `steps` calls after WARMUP_STEPS more). rewind, before each call
    and outside its time, puts the cache back where the step found it, so that every step decodes at the same slot: it
    is no part of a decode step (32 launches of a fill took about 0.8 ms on an H100's host, a sixteenth of an lrkv
    step). Warm-up: on an H100 the windowed budget plan's first replays after the one that records its CUDA graph took
    12.0, 12.6, 12.0, 11.8 and 11.7 ms, the rest 11.6-11.7 (docs/gpu-notes.md, stop 67), so the timed steps start
    after them."""
    first = timed_call(step, rewind, device)
    for _ in range(WARMUP_STEPS):
        timed_call(step, rewind, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = sorted(timed_call(step, rewind, device) for _ in range(steps))
    return first, times[len(times) // 2]


def error_row(path, batch, context, error):
    """A path that fails is reported with its error, and the others still run."""
    row = dict(path=path, batch=batch, context=context, error=f"{type(error).__name__}: {error}"[:2000])
    print(json.dumps(row))
    return row


def step_row(path, batch, context, step_s, cache_bytes, first, compiled, **more):
    """A timed path's row: its step's seconds as ms and tokens/s, its cache's GiB, `more`, and its compile time (the
    first call's seconds less a step's) where it compiles."""
    return dict(path=path, batch=batch, context=context, ms_per_step=1e3 * step_s, tokens_per_s=batch / step_s,
                cache_GiB=cache_bytes / 2**30, **more, compile_s=first - step_s if compiled else None)


def measure(path, step, rewind, cache_bytes, batch, context, steps, device, compiled, profile=False):
    kernel_calls.clear()
    try:
        first, step_s = time_steps(step, steps, device, rewind)
    except Exception as error:
        return error_row(path, batch, context, error)
    launches = len(kernel_calls) / (steps + 1 + WARMUP_STEPS)
    if profile:  # where a step's time goes: the device kernels of three steps, most time first
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for _ in range(3):
                rewind()
                step()
        print(profiler.key_averages().table(sort_by="self_cuda_time_total" if device.type == "cuda"
                                            else "self_cpu_time_total", row_limit=15))
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    row = step_row(path, batch, context, step_s, cache_bytes, first, compiled, peak_GiB=peak / 2**30)
    row["kernel_calls_per_step"] = launches  # Triton decode launches (lrkv paths)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        per_sequence = cache_bytes / batch
        row["max_batch"] = int((total - (peak - cache_bytes)) // per_sequence)
    print(json.dumps(row))
    return row


@dataclasses.dataclass
class Alternating:
    """A path set up for --alternate: its step, the rewind before each, its cache's bytes, whether it compiles, and
    the attention function (`config._attn_implementation`) it was set up under, put back before each of its steps."""
    path: str
    step: object
    rewind: object
    cache_bytes: int
    compiled: bool
    implementation: str


BURSTS = 3  # --alternate: rounds of back-to-back steps, one burst of `steps` steps of each path a round


def measure_alternately(paths, model, batch, context, steps, device):
    """Rows of `paths` timed in turns: each path's first call (its compile, where it compiles) and WARMUP_STEPS more,
    one path after the other, then `steps` rounds of one step of each (`split_call`), then BURSTS rounds of one burst
    of `steps` steps of each (`back_to_back`). A path's row takes the median of its steps: ms_per_step, the host's
    enqueue_ms, and back_to_back_ms (the median burst's time a step). A path whose first calls fail is a row with its
    error. The attention function each path was set up under is put back before each of its calls: compiled paths of
    one model share Dynamo's cache entries, told apart only by its guard on that setting, so a step under another
    path's setting would run that path's graph."""
    def under(path, timing, *arguments):
        model.config._attn_implementation = path.implementation
        return timing(path.step, path.rewind, device, *arguments)
    first, rows, running = {}, [], []
    try:
        for path in paths:
            try:
                first[path.path] = under(path, timed_call)
                for _ in range(WARMUP_STEPS):
                    under(path, timed_call)
            except Exception as error:
                rows.append(error_row(path.path, batch, context, error))
            else:
                running.append(path)
        times = {path.path: [] for path in running}
        bursts = {path.path: [] for path in running}
        for _ in range(steps):
            for path in running:
                times[path.path].append(under(path, split_call))
        for _ in range(BURSTS):
            for path in running:
                bursts[path.path].append(under(path, back_to_back, steps))
    finally:
        model.config._attn_implementation = "sdpa"
    for path in running:
        enqueue_s, step_s = (sorted(part)[steps // 2] for part in zip(*times[path.path]))
        rows.append(step_row(path.path, batch, context, step_s, path.cache_bytes, first[path.path], path.compiled,
                             enqueue_ms=1e3 * enqueue_s,
                             back_to_back_ms=1e3 * sorted(bursts[path.path])[BURSTS // 2]))
        rows[-1]["alternated"] = True
        print(json.dumps(rows[-1]))
    return rows


class Rows(list):
    """The run's rows, written to benchmarks/results/<benchmark>-<gpu>.json (generate, or generate-alternate) after
    each one (a run cut short keeps what it measured). With --only, the file's rows of the other paths stay, from the
    run that wrote them."""

    def __init__(self, out, device, layers, wanted, benchmark="generate"):
        super().__init__()
        self.path, self.kept = None, []
        if out is None:
            return
        gpu = torch.cuda.get_device_name(device)
        self.path = attention.results_path(out, benchmark, gpu)
        self.header = dict(gpu=gpu, torch=torch.__version__, layers=layers)
        if self.path.exists():
            self.kept = [row for row in json.loads(self.path.read_text())["rows"] if not wanted(row["path"])]

    def append(self, row):
        super().append(row)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(dict(self.header, rows=self.kept + list(self)), indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tiny", action="store_true", help="a small model on CPU (checks the script)")
    parser.add_argument("--only", nargs="+", help="run only the paths whose name contains one of these texts")
    parser.add_argument("--profile", action="store_true", help="also print each path's most expensive kernels")
    parser.add_argument("--alternate", action="store_true",
                        help="time the paths in turns, one step of each a round, all set up at once")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: time at least one step")
    if args.alternate and args.profile:
        parser.error("--alternate and --profile: profile the paths in a run of their own")
    if args.alternate and not args.only:
        parser.error("--alternate needs --only: the paths to alternate, whose caches fit the device together")
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        args.context, args.batch, args.layers, args.steps = 64, 2, 2, 3
    dtype = torch.float32 if args.tiny else torch.float16
    model = build_model(TINY if args.tiny else LLAMA3_8B, args.layers, device, dtype)
    batch, context = args.batch, args.context
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    def wanted(path):
        return args.only is None or any(text in path for text in args.only)

    rows = Rows(None if args.tiny else pathlib.Path(args.out), device, args.layers, wanted,
                "generate-alternate" if args.alternate else "generate")
    alternating = []  # --alternate: the paths set up, timed in turns once all are

    def take(path, step, rewind, cache_bytes, compiled):
        """Times a path now, or with --alternate keeps it (and the attention function it was set up under)."""
        if args.alternate:
            alternating.append(Alternating(path, step, rewind, cache_bytes, compiled,
                                           model.config._attn_implementation))
        else:
            rows.append(measure(path, step, rewind, cache_bytes, batch, context, args.steps, device, compiled,
                                args.profile))

    # Random weights have no low-rank structure for a search to find, so the plans are set by hand, head-wise,
    # plain SVD: "budget 0.2" spends about a fifth of the 16-bit cache's bytes as a calibrated plan does (keys at
    # half rank and 4 bits, values at full rank and 3 bits, a scale per 32 channels, 4 exact sink tokens); "keep
    # 0.5" keeps half the channels in 16 bits; "RoPE window 1024" is budget 0.2 with windowed RoPE beyond 1024 tokens
    # (`RankPlan.rope_window`: the kernel scores the far slots against their latents, rebuilding no key).
    plans = [("lrkv budget 0.2", lambda: lrkv.RankPlan.uniform(
                 model, keep_k=0.5, keep_v=1.0, bits_k=4, bits_v=3, group=32, sinks=4, scheme="head", context=context,
                 progress=False)),
             ("lrkv budget 0.2, RoPE window 1024", lambda: lrkv.RankPlan.uniform(
                 model, keep_k=0.5, keep_v=1.0, bits_k=4, bits_v=3, group=32, sinks=4, scheme="head", context=context,
                 rope_window=1024, progress=False)),
             ("lrkv keep 0.5", lambda: lrkv.RankPlan.uniform(model, keep=0.5, scheme="head", progress=False))]
    # each plan compiled as lrkv.compile does by default (Inductor around the latent ops) and with Inductor's
    # reduce-overhead mode (CUDA graphs replay the whole step: no launch cost per op)
    lrkv_modes = ["default"] if args.tiny else ["default", "reduce-overhead"]
    runs = [(name if mode == "default" else f"{name}, {mode}", make_plan, mode)
            for name, make_plan in plans for mode in lrkv_modes]
    for name, make_plan, mode in runs:
        if not wanted(name):
            continue
        plan = make_plan()
        print(name, plan.summary())
        cache = lrkv.LatentCache(model, plan, max_batch_size=batch, max_cache_len=context)
        lm = lrkv.compile(model, plan, mode=mode)

        def step(lm=lm, cache=cache):
            with torch.no_grad():
                lm(input_ids=token, **{lrkv.cache_keyword(model): cache}, use_cache=True)
        fill_latent(cache, context)
        take(name, step, rewinder(cache, context), cache.nbytes(), True)
        del cache, lm, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    position = torch.full((batch, 1), context - 1, device=device)
    cache_position = torch.tensor([context - 1], device=device)
    for implementation in ("sdpa", "sdpa_gqa"):
        model.config._attn_implementation = implementation
        label = "StaticCache (transformers' SDPA)" if implementation == "sdpa" else "StaticCache + SDPA enable_gqa"
        modes = [("eager", model.forward, False)]
        if not args.tiny:
            modes.append(("compiled reduce-overhead", torch.compile(model.forward, mode="reduce-overhead",
                                                                    fullgraph=True), True))
        modes = [mode for mode in modes if wanted(f"{label}, {mode[0]}")]
        if not modes:
            continue
        cache = StaticCache(config=model.config, max_cache_len=context)
        fill_static(model, cache, batch, context)
        cache_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        for mode, forward, compiled in modes:
            def step(forward=forward, cache=cache):
                with torch.no_grad():
                    forward(input_ids=token, **{lrkv.cache_keyword(model): cache}, use_cache=True,
                            position_ids=position, cache_position=cache_position)
            take(f"{label}, {mode}", step, rewinder(cache, context), cache_bytes, compiled)
        del cache, modes, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model.config._attn_implementation = "sdpa"

    label = "QuantizedCache int4 (quanto), eager"
    if wanted(label):
        def rewind():
            for layer, (keys, values) in zip(cache.layers, residuals):  # every step appends to the same residual
                layer.keys, layer.values, layer.cumulative_length = keys, values, context - 1

        def step():
            with torch.no_grad():
                model(input_ids=token, **{lrkv.cache_keyword(model): cache}, use_cache=True, position_ids=position,
                      cache_position=cache_position)
        try:  # without optimum-quanto the cache cannot be built: the row says so
            cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=64)
            fill_quantized(model, cache, batch, context)
            residuals = [(layer.keys, layer.values) for layer in cache.layers]
            step()  # untimed: the cache then holds `context` tokens, as each timed step finds it
            cache_bytes = held_bytes(tensor for layer in cache.layers for tensor in (
                layer._quantized_keys, layer._quantized_values, layer.keys, layer.values))
        except Exception as error:
            rows.append(error_row(label, batch, context, error))
        else:
            take(label, step, rewind, cache_bytes, False)
    if alternating:
        for row in measure_alternately(alternating, model, batch, context, args.steps, device):
            rows.append(row)
    if rows.path is not None:
        print(f"wrote {rows.path}")


if __name__ == "__main__":
    main()
