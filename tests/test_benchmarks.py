"""The GPU benchmarks' logic on CPU: `benchmarks/generate.py --tiny` runs every path on a small model,
`benchmarks/attention.py --tiny` (and its `--sweep` over three plans) and `benchmarks/prefill.py --tiny` every plan
under Triton's interpreter (they time nothing useful there; the figures come from the GPU); and the CPU decode
benchmark, `benchmarks/cpu_decode.py --tiny`, on a small random model."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_generate_benchmark_runs_every_path_on_a_tiny_model():
    result = subprocess.run([sys.executable, "benchmarks/generate.py", "--tiny"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["path"] for row in rows] == ["lrkv budget 0.2", "lrkv budget 0.2, RoPE window 1024", "lrkv keep 0.5",
                                             "StaticCache (transformers' SDPA), eager",
                                             "StaticCache + SDPA enable_gqa, eager",
                                             "QuantizedCache int4 (quanto), eager"]
    lrkv_cache, full_cache, quantized_cache = rows[0]["cache_GiB"], rows[3]["cache_GiB"], rows[5]["cache_GiB"]
    assert rows[1]["cache_GiB"] == lrkv_cache  # windowed RoPE changes what is computed, not what is stored
    # the budget plan's cache against the tiny fp32 model's full one: half its fraction of a 16-bit cache (0.26
    # at 64 tokens, where its 4 exact sink tokens weigh more than at 16K)
    assert 0.12 < lrkv_cache / full_cache < 0.135
    # QuantizedCache's bytes as read from the cache after a step at 64 tokens: 32 quantized (4 bits, an fp32 scale
    # and zero point per 64 values: 0.156 of fp32) and 32 in its fp32 residual, 0.578 of the full cache in all.
    # Leaving out the residual would read 0.08, the scales and zero points 0.56; counting a dequantized copy, 1 or more.
    assert 0.57 < quantized_cache / full_cache < 0.585
    assert all(row["tokens_per_s"] > 0 for row in rows)


def test_generate_benchmark_alternates_the_paths_it_is_given():
    """--alternate with two --only texts: both paths set up, then timed in turns (before each step the attention
    function its path was set up under is put back: transformers' SDPA for lrkv's, sdpa_gqa for the fair baseline's);
    peaks left out; --profile with it refused, and --steps 0."""
    result = subprocess.run([sys.executable, "benchmarks/generate.py", "--tiny", "--alternate", "--only",
                             "RoPE window 1024", "enable_gqa"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["path"] for row in rows] == ["lrkv budget 0.2, RoPE window 1024",
                                             "StaticCache + SDPA enable_gqa, eager"]
    assert all(row["alternated"] and row["ms_per_step"] > 0 and "peak_GiB" not in row for row in rows)
    assert all(0 < row["enqueue_ms"] <= row["ms_per_step"] and row["back_to_back_ms"] > 0 for row in rows)
    assert rows[0]["cache_GiB"] < rows[1]["cache_GiB"] / 5
    for arguments, error in ((["--profile", "--only", "budget"], "profile the paths in a run of their own"),
                             ([], "--alternate needs --only"),
                             (["--only", "budget", "--steps", "0"], "time at least one step")):
        refused = subprocess.run([sys.executable, "benchmarks/generate.py", "--tiny", "--alternate", *arguments],
                                 cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2 and error in refused.stderr


ALTERNATING = """
import json, sys, types
import torch
import generate
model = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="eager"))
seen = []
def step(name):
    def call():
        seen.append((name, model.config._attn_implementation))
        if name == "broken":
            raise RuntimeError("out of memory")
    return call
paths = [generate.Alternating(name, step(name), lambda: None, 1024, name == "a", implementation)
         for name, implementation in (("a", "sdpa"), ("broken", "sdpa"), ("b", "sdpa_gqa"))]
rows = generate.measure_alternately(paths, model, 2, 64, 3, torch.device("cpu"))
print(json.dumps(dict(rows=rows, seen=seen, last=model.config._attn_implementation)))
"""


def test_alternating_paths_run_in_turns_each_under_its_own_attention_function():
    """measure_alternately on stand-in paths: each path's first call and six warm-up calls in turn, then rounds of one
    step of each, then rounds of a burst of steps of each, every call under the attention function its path was set up
    with; a path that fails its first call
    is an error row and leaves the rounds; the model's setting is put back to transformers' SDPA at the end."""
    result = subprocess.run([sys.executable, "-c", ALTERNATING], cwd=ROOT / "benchmarks", capture_output=True,
                            text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert [tuple(call) for call in out["seen"]] == ([("a", "sdpa")] * 7 + [("broken", "sdpa")] + [("b", "sdpa_gqa")] * 7
                           + [("a", "sdpa"), ("b", "sdpa_gqa")] * 3  # rounds of one step of each
                           + ([("a", "sdpa")] * 3 + [("b", "sdpa_gqa")] * 3) * 3)  # rounds of a burst of each
    assert [row["path"] for row in out["rows"]] == ["broken", "a", "b"]
    assert "out of memory" in out["rows"][0]["error"]
    assert all(0 < row["enqueue_ms"] <= row["ms_per_step"] and row["back_to_back_ms"] > 0 for row in out["rows"][1:])
    assert [row["compile_s"] is not None for row in out["rows"][1:]] == [True, False]
    assert out["last"] == "sdpa"

def test_cpu_decode_benchmark_times_both_paths_at_each_context_on_a_tiny_model():
    result = subprocess.run([sys.executable, "benchmarks/cpu_decode.py", "--tiny", "--steps", "2"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(row["path"].split(", ")[1], row["context"]) for row in rows] == [
        ("DynamicCache", 16), ("lrkv", 16), ("DynamicCache", 40), ("lrkv", 40)]
    assert all(row["ms_per_step"] > 0 and row["tokens_per_s"] > 0 for row in rows)


def test_prefill_benchmark_runs_every_plan_against_the_reference_on_a_tiny_model():
    result = subprocess.run([sys.executable, "benchmarks/prefill.py", "--tiny"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(row["batch"], row["prefix"], row["tokens"]) for row in rows[::4]] == [(1, 0, 24), (2, 40, 9)]
    assert [row["plan"] for row in rows[:4]] == ["head keep 0.5", "head keep 0.25", "budget 0.2", "budget 0.2 w1024"]
    # the kernel against the reference op, a whole prompt and a chunk after a cached prefix, each plan
    assert all(row["relative_error"] is not None and row["relative_error"] < 2e-3 for row in rows)


def test_attention_benchmark_refuses_a_negative_count_of_extra_slots():
    result = subprocess.run([sys.executable, "benchmarks/attention.py", "--tiny", "--extra-slots", "-1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "--extra-slots -1: a count of slots to add, 0 or more" in result.stderr


def _tiny_attention(*arguments):
    result = subprocess.run([sys.executable, "benchmarks/attention.py", "--tiny", *arguments], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_attention_benchmark_runs_every_plan_against_the_reference_on_a_tiny_shape():
    _, rows = _tiny_attention("--extra-slots", "3")
    assert {row["context"] for row in rows} == {203}  # 200 and the extra slots
    assert [row["plan"] for row in rows] == ["head keep 0.5", "head keep 0.25", "budget 0.2", "head keep 0.5 w1024",
                                             "head keep 0.25 w1024", "budget 0.2 w1024", "joint keep 0.5",
                                             "joint keep 0.25"]
    # every row's kernel against the reference op (float16 queries and latents)
    assert all(row["relative_error"] is not None and row["relative_error"] < 5e-3 for row in rows)
    assert not any(row["mask"] for row in rows)
    # windowed plans at a window that leaves far tiles in 200 slots; the bytes read shrink with the plan
    assert [row["rope_window"] for row in rows[3:6]] == [48, 48, 48]
    ratio = {row["plan"]: row["bytes_ratio"] for row in rows}
    assert 1.5 < ratio["head keep 0.5"] < ratio["head keep 0.25"] < ratio["budget 0.2"]
    for row in rows:
        assert row["geometry"].startswith(f"{row['config']['block_s']}/{row['config']['num_warps']}w/")


def test_attention_benchmark_sweeps_launch_geometries_and_runs_each_plan_at_its_fastest():
    """The sweep times the candidate geometries of the head-wise plans but exact keep 0.5 (which takes keep 0.25's),
    refuses 8 warps over codes, and each plan then runs at its sweep's fastest (three plans: the sweep's logic is
    the same for the others, each of which the test above runs), here with the mask of a model's decode step."""
    stdout, rows = _tiny_attention("--sweep", "--mask", "--plans", "head keep 0.5", "head keep 0.25",
                                   "budget 0.2 w1024")
    assert [row["plan"] for row in rows] == ["head keep 0.5", "head keep 0.25", "budget 0.2 w1024"]
    assert all(row["mask"] for row in rows)
    assert all(row["relative_error"] is not None and row["relative_error"] < 5e-3 for row in rows)
    sweeps = [line for line in stdout.splitlines() if line.startswith("sweep tiny")]
    assert [line.split(":")[0] for line in sweeps] == ["sweep tiny head keep 0.25", "sweep tiny budget 0.2 w1024"]
    assert "num_warps=8 over quantized latents" in stdout
    fastest = {line.split(":")[0].removeprefix("sweep tiny "): line.split(": ")[1].split(", ")[0].split(" ms ")[1]
               for line in sweeps}
    for row in rows:
        swept = fastest["head keep 0.25" if row["plan"] == "head keep 0.5" else row["plan"]]
        assert swept == row["geometry"], (row["plan"], swept, row["config"])


H100_RESULTS = ["benchmarks/results/attention-nvidia-h100-80gb-hbm3-8b0512c.json",
                "benchmarks/results/attention-nvidia-h100-80gb-hbm3-8b0512c-rest.json",
                "benchmarks/results/attention-nvidia-h100-80gb-hbm3-d02bdb8.json",
                "benchmarks/results/attention-nvidia-h100-80gb-hbm3-1b74a82.json",
                "benchmarks/results/attention-nvidia-h100-80gb-hbm3-06f0e7f.json"]


def test_the_attention_plot_takes_each_rows_newest_run(tmp_path):
    out = tmp_path / "attention.png"
    result = subprocess.run([sys.executable, "benchmarks/plot_attention.py", *H100_RESULTS, "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {(row["shape"], row["plan"], row["context"]): row for row in map(json.loads, result.stdout.splitlines())}
    # 2 shapes x 6 head-wise plans x 2 contexts with a target (16K, 64K); the joint plans' rows were skipped there
    assert len(rows) == 24 and all(row["target"] for row in rows.values())
    # in the newest file, and in older ones too: the newest wins
    newest = rows[("llama3-8b", "budget 0.2 w1024", 16384)]
    assert newest["source"].endswith("06f0e7f.json") and newest["speedup"] == 3.153
    assert rows[("llama3-8b", "head keep 0.25 w1024", 16384)]["source"].endswith("1b74a82.json")
    assert rows[("llama3-8b", "head keep 0.25", 16384)]["source"].endswith("8b0512c-rest.json")


def test_the_attention_plot_refuses_a_file_that_is_not_a_result(tmp_path):
    bogus = tmp_path / "rows.json"
    bogus.write_text("[1, 2]")
    result = subprocess.run([sys.executable, "benchmarks/plot_attention.py", str(bogus), "--out",
                             str(tmp_path / "x.png")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "not a result file of benchmarks/attention.py" in result.stderr
