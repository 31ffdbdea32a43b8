"""The fuzzer (`lrkv fuzz`): a short run passes, each graph mutation keeps the graph's meaning and is undone by
canonicalization, and a planted bug is caught, shrunk and printed as a reproducer."""
import json
import random

import pytest
import torch

import lrkv_compile as lrkv
from lrkv_compile import fuzz, zoo
from lrkv_compile.cli import main
from lrkv_compile.passes.canonicalize import canonicalize


def test_a_short_fuzz_run_passes(tmp_path):
    summary_path = tmp_path / "fuzz.json"
    main(["fuzz", "--examples", "6", "--seed", "3", "--family", "qwen3", "gpt2", "--json", str(summary_path)])
    summary = json.loads(summary_path.read_text())
    assert summary["examples"] >= 6 and "failure" not in summary
    assert set(summary["passed"]["check"]) <= set(fuzz.CHECKS)


def traced(family, ids):
    """The Dynamo graph of `family`'s forward (no cache) and its example inputs."""
    model = zoo.build(family, layers=2, heads=4, kv_heads=2, head_dim=8)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward
    torch._dynamo.reset()
    torch.compile(model.forward, backend=keep)(input_ids=ids, use_cache=False)
    return graphs[0]


UNDONE_BY = {"no-ops": ("no-op cast", "no-op reshape", "contiguous"), "split": ("split linear",),
             "fuse": ("fused linear",)}


@pytest.mark.parametrize("mutation", sorted(fuzz.MUTATIONS))
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_each_mutation_keeps_the_meaning_and_canonicalization_undoes_it(family, mutation):
    ids = torch.randint(3, zoo.VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    gm, example_inputs = traced(family, ids)
    expected = gm(*example_inputs)[0]
    canonicalize(gm)  # the graph as the matcher sees it
    nodes = len(gm.graph.nodes)
    assert fuzz.MUTATIONS[mutation](gm, random.Random(1)) > 0, f"{mutation} changed nothing"
    gm.graph.lint()
    gm.recompile()
    torch.testing.assert_close(gm(*example_inputs)[0], expected, rtol=0, atol=1e-6)
    fired = canonicalize(gm)
    if mutation in UNDONE_BY:
        assert sum(fired[rule] for rule in UNDONE_BY[mutation]) > 0 and len(gm.graph.nodes) == nodes
    torch.testing.assert_close(gm(*example_inputs)[0], expected, rtol=0, atol=1e-6)


def test_mutated_graphs_are_still_rewritten():
    fuzz.check(fuzz.Case("llama", check="truncated", keep=0.5, batch=2, padding=1, mutations=tuple(fuzz.MUTATIONS)))


def test_a_prompt_longer_than_a_sliding_window_ring_of_channel_axis_blocks():
    """Found by `lrkv fuzz --examples 200 --seed 7`: a Gemma 3 sliding-window layer's ring of per-channel blocks,
    written by a prompt longer than the ring, keeps only the prompt's last blocks, which start after the prompt's
    first index; the reference write asked for the indices between them backwards and raised."""
    fuzz.check(fuzz.Case(family="gemma3", check="decode", layers=1, kv_heads=1, ratio=1, head_dim=8, keep=0.25,
                         bits=8, group=4, axis="channel", prompt=8, steps=1))


def test_a_planted_bug_is_caught_shrunk_and_reproducible(monkeypatch, capsys, tmp_path):
    """A LatentCache attention that is wrong for batches of more than one sequence: the fuzzer fails, shrinks
    the case (for ten seconds), and prints a reproducer that fails the same way."""
    from lrkv_compile.lowering import reference
    right = reference.latent_attention

    def wrong_for_batches(**arguments):
        out = right(**arguments)
        return out * 1.01 if out.shape[0] > 1 else out
    monkeypatch.setattr(reference, "latent_attention", wrong_for_batches)
    summary_path = tmp_path / "fuzz.json"
    with pytest.raises(SystemExit) as exit_:
        main(["fuzz", "--examples", "10", "--seed", "0", "--family", "llama", "--check", "decode",
              "--shrink-seconds", "10", "--json", str(summary_path)])
    assert exit_.value.code == 1
    summary = json.loads(summary_path.read_text())
    assert f"reproduce: {summary['reproducer']}" in capsys.readouterr().out
    case = eval(summary["failure"], vars(fuzz))
    assert summary["reproducer"].endswith(f"check({summary['failure']})\"")
    found = eval(summary["found"], vars(fuzz))
    tokens = lambda case: case.batch * (case.prompt + case.steps)  # noqa: E731  (what a case runs)
    assert case.check == "decode" and case.batch > 1 and tokens(case) <= tokens(found)
    with pytest.raises(fuzz.Mismatch, match="LatentCache tokens"):
        fuzz.check(case)
    monkeypatch.setattr(reference, "latent_attention", right)
    fuzz.check(case)


def test_dynamic_true_is_a_clear_error():
    model = zoo.build("llama", layers=1)
    plan = lrkv.RankPlan.uniform(model, keep=0.5, progress=False)
    forward = torch.compile(model.forward, backend="lrkv", options={"plan": plan}, dynamic=True)
    with pytest.raises(Exception, match=r"dynamic=True\) is not supported.*Leave dynamic at its default"):
        forward(input_ids=torch.randint(3, zoo.VOCAB, (1, 5)), use_cache=False)


def test_a_dropped_contiguous_turns_every_view_of_its_memory_into_a_reshape():
    """Found by the fuzzer (GPT-J with a no-op view after its merge-heads contiguous): x.permute(...).contiguous()
    .view(same shape).view(merged) must still run once the contiguous and the no-op view are gone."""
    def merge_heads(x):
        return x.permute(0, 2, 1, 3).contiguous().view(2, 5, 3, 4).view(2, 5, 12) * 2
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    x = torch.randn(2, 3, 5, 4)
    torch.compile(merge_heads, backend=keep)(x)
    gm = graphs[0]
    fired = canonicalize(gm)
    assert fired["contiguous"] == 1 and fired["no-op reshape"] == 1
    torch.testing.assert_close(gm(x)[0], merge_heads(x), rtol=0, atol=0)
