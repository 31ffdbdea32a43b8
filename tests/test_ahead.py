"""`lowering.ahead`: a decode graph's Triton kernels compile in worker threads while Inductor compiles the graph, for
the arguments the ops are then called with, and the ops' first call waits for them. On CPU: the arguments it builds
against the ones a tiny model's step passes, and the launch helper's compile-only mode through a stand-in kernel; on
a GPU: that a first step's kernels all compiled in the workers."""
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import lrkv_compile as lrkv
from lrkv_compile import backend
from lrkv_compile.lowering import ahead, reference
from transformers import LlamaConfig, LlamaForCausalLM


def _tiny_llama(layers=2):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, vocab_size=512, num_hidden_layers=layers, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _describe(value):
    if isinstance(value, torch.Tensor):  # the storage offset too: the value latents are a view past the keys'
        return value.dtype, value.device, tuple(value.shape), value.stride(), value.storage_offset()
    return value


def test_the_arguments_compiled_ahead_are_the_ones_a_decode_step_passes(monkeypatch):
    model = _tiny_llama()
    plan = lrkv.RankPlan.uniform(model, keep_k=0.5, keep_v=1.0, bits_k=4, bits_v=3, group=32, sinks=4,
                                 scheme="head", context=64, rope_window=16, progress=False)
    cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=64)
    state = [tensor for layer in cache.layers for tensor in (*layer.tensors(), layer.cumulative_length)]
    ahead_calls, unchanged = [], []
    lower = backend.lower

    def spy(gm, example_inputs, *args, **kwargs):
        before = [tensor.clone() for tensor in state]
        ahead_calls.append(ahead.calls(gm, example_inputs))
        unchanged.append(all(torch.equal(a, b) for a, b in zip(before, state)))
        return lower(gm, example_inputs, *args, **kwargs)
    monkeypatch.setattr(backend, "lower", spy)
    called = []
    for name in ("latent_attention", "latent_write"):
        op = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda op=op, name=name, **kwargs: called.append((name, kwargs)) or
                            op(**kwargs))
    lm = lrkv.compile(model, plan)
    with torch.no_grad():
        lm(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), **{lrkv.cache_keyword(model): cache}, use_cache=True)
        prompt_calls = len(called)
        lm(input_ids=torch.tensor([[7], [8]]), **{lrkv.cache_keyword(model): cache}, use_cache=True)
    assert len(ahead_calls) == 2 and unchanged == [True, True]  # the cache as it was, for both graphs
    assert ahead_calls[0] == []  # the prompt's graph: nothing ahead
    decode = {}  # each op's arguments with its defaults, as the op's call binds them
    for function, kwargs in ahead_calls[1]:
        bound = inspect.signature(function).bind(**kwargs)
        bound.apply_defaults()
        decode[function.__name__] = bound.arguments
    assert sorted(decode) == ["latent_attention", "latent_write"]  # one of each: both layers' calls are alike
    steps = called[prompt_calls:]
    assert len(steps) == 4
    for name, kwargs in steps:
        expected = decode[name]
        assert sorted(set(expected) - {"implementation"}) == sorted(kwargs)  # `start` sets the implementation
        for argument, value in kwargs.items():
            if argument not in ahead.HOST_ONLY:  # the first layer's write asserts the context on the device, not both
                assert _describe(expected[argument]) == _describe(value), (name, argument)
        # the cache's own tensors are handed over as they are (their addresses are part of what compiles); the
        # first layer's, as both layers' calls compile alike
        first = cache.layers[0]
        assert expected["latent_k"] is first.keys and expected["length"] is first.cumulative_length


class Kernel:
    """A stand-in JIT kernel: records compiles (warmup) and launches apart."""

    def __init__(self):
        self.params, self.arg_names = [], []
        self.compiled, self.launched = [], []

    def warmup(self, *args, grid, **constants):
        self.compiled.append((grid, args, constants))

    def __getitem__(self, grid):
        return lambda *args, **constants: self.launched.append((grid, args, constants))


def test_a_thread_compiling_ahead_compiles_in_a_worker_and_the_ops_first_call_waits(monkeypatch):
    pytest.importorskip("triton", reason="the launch helper needs the triton package")
    from lrkv_compile.lowering import launch
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel, x = Kernel(), torch.zeros(4)
    threads = []

    def job():
        threads.append(ahead.compiling())
        launch.launch(kernel, (3,), (x, 7), dict(BLOCK=16, num_warps=4))
        ahead.settle()  # on a worker: returns at once rather than waiting for itself
    ahead._submit(job, torch.device("cpu"))
    ahead.settle()
    assert threads == [True] and not ahead.compiling() and not ahead._PENDING
    assert kernel.compiled == [((3,), (x, 7), dict(BLOCK=16, num_warps=4))] and kernel.launched == []


def test_a_failed_compile_ahead_is_left_to_the_real_launch():
    def job():
        raise RuntimeError("out of resources")
    ahead._submit(job, torch.device("cpu"))
    ahead.settle()  # raises nothing: the launch compiles it again and raises what it raises


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton compiler for a device); on "
                    "CPU the arguments and the compile-only launch are tested above")
def test_a_decode_steps_kernels_compile_in_the_workers_on_the_gpu(tmp_path):
    """In a fresh process with an empty Triton cache: every Triton kernel the first decode step needs compiled in
    lrkv's workers, none on the thread that runs the step, for the budget plan with windowed RoPE over a cache long
    enough for the far loop."""
    script = textwrap.dedent("""
        import json, threading
        import torch, triton
        import lrkv_compile as lrkv
        from transformers import LlamaConfig, LlamaForCausalLM
        compiles = []
        def hook(*, fn, **_):
            compiles.append((threading.current_thread().name, fn.module, fn.name))
        triton.knobs.runtime.jit_post_compile_hook = hook
        config = LlamaConfig(hidden_size=512, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=128, vocab_size=512, num_hidden_layers=2, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to("cuda", torch.float16).eval()
        plan = lrkv.RankPlan.uniform(model, keep_k=0.5, keep_v=1.0, bits_k=4, bits_v=3, group=32, sinks=4,
                                     scheme="head", context=8192, rope_window=1024, progress=False)
        cache = lrkv.LatentCache(model, plan, max_batch_size=2, max_cache_len=8192)
        for layer in cache.layers:
            layer.cumulative_length.fill_(4000)
        lm = lrkv.compile(model, plan)
        with torch.no_grad():
            lm(input_ids=torch.zeros(2, 1, dtype=torch.long, device="cuda"), **{lrkv.cache_keyword(model): cache},
               use_cache=True)
        torch.cuda.synchronize()
        print(json.dumps(compiles))
        """)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    compiles = json.loads(run.stdout.strip().splitlines()[-1])
    lrkv_kernels = [(thread, name) for thread, module, name in compiles if not module.startswith("torch")]
    names = {name for _, name in lrkv_kernels}
    assert {"latent_write_kernel", "latent_decode_kernel", "far_prep_kernel", "far_kernel",
            "combine_project_kernel"} <= names, compiles
    assert all(thread.startswith("lrkv-compile") for thread, _ in lrkv_kernels), compiles
