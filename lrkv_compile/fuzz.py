"""The fuzzer: random architectures, plans and inputs through the backend, checked against what they must equal.

    lrkv fuzz --examples 200 --seed 0          # or lrkv_compile.fuzz.fuzz(200, seed=0)

Hypothesis draws a `Case`: a family of the zoo with its dimensions (layers, heads, GQA ratio, head_dim), dtype,
attention implementation, RoPE scaling, sliding window; a plan (keep, scheme, bits, scale group and axis,
rotation, sinks, window); batch, left padding and lengths; and mutations of the traced graph that keep its
meaning (`MUTATIONS`: no-op views/casts/contiguous, independent nodes reordered, projections split by rows or
fused by concatenated weights), applied before the backend sees it. Each case runs one `CHECKS` contract:

- full: a full-rank 16-bit plan through `torch.compile(..., backend="lrkv")` gives the original logits;
- truncated: a truncated plan gives the eager low-rank reference's logits (`lrkv.low_rank_reference`);
- decode: prefill and single-token steps through a `LatentCache` give the reference's logits, each step one
  full forward of it (`stepwise`: quantized latents where the cache holds them quantized).

and every attention site of every graph must have been rewritten: a mutation that defeats the matcher is a
failure too. A failure is shrunk to its smallest case and printed as a line of Python that reproduces it.
"""
import operator
import random
import warnings
from collections import Counter
from dataclasses import dataclass, fields

import torch
from torch.fx import GraphModule, Node

from . import backend, zoo
from .errors import LrkvWarning, PlanError
from .passes.canonicalize import _writes_in_place
from .passes.patterns import LINEAR_TARGETS
from .trace import cache_keyword

TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}
"""The one tolerance table of every numerical comparison (the fuzzer's and the tests')."""

CHECKS = ("full", "truncated", "decode")
ROPE_SCALING = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},  # 512 / 128 = factor
    # recomputed per call: the forward splits into graphs, a LatentCache stores cos/sin rows (lrkv_compile/rotary.py);
    # within the original 512 positions the frequencies stay those of a step decode and of one full forward alike
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
ROPE_SCALED = ("llama", "mistral", "qwen2", "qwen3")  # families whose config takes rope_parameters as Llama's
SLIDING = {"mistral", "mixtral", "gemma2", "gemma3"}


@dataclass(frozen=True)
class Case:
    """One fuzz example; `repr(case)` is the Python that rebuilds it (`check(Case(...))` reruns it)."""
    family: str
    check: str = "full"
    layers: int = 2
    kv_heads: int = 2
    ratio: int = 2                 # query heads per KV head
    head_dim: int = 16
    dtype: str = "float32"
    attention: str = ""            # "" = the family's own implementation
    rope: str = ""                 # a ROPE_SCALING key, "" = none
    sliding_window: int = 0        # 0 = the family's default (sliding families only)
    keep: float = 1.0
    scheme: str = "head"
    bits: int = 16
    group: int = 8
    axis: str = "token"
    rotation: str = "none"
    sinks: int = 0
    window: int = 0
    batch: int = 1
    padding: int = 0               # left padding of the first row
    prompt: int = 4
    steps: int = 0
    mutations: tuple = ()
    seed: int = 0

    def __repr__(self):
        default = Case(self.family)
        given = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                          if f.name == "family" or getattr(self, f.name) != getattr(default, f.name))
        return f"Case({given})"

    def model(self):
        overrides = {}
        if self.rope:
            overrides["rope_parameters"] = {**ROPE_SCALING[self.rope], "rope_theta": 10000.0}
        if self.sliding_window:
            overrides["sliding_window"] = self.sliding_window
        return zoo.build(self.family, layers=self.layers, heads=self.kv_heads * self.ratio, kv_heads=self.kv_heads,
                         head_dim=self.head_dim, dtype=getattr(torch, self.dtype), seed=self.seed,
                         attention=self.attention or None, **overrides)

    def plan(self, model):
        from .plan import RankPlan
        options = dict(scheme=self.scheme, bits=self.bits, progress=False)
        if self.scheme == "group":
            options["group_size"] = 2  # KV heads per latent
        if self.bits != 16:
            options.update(group=self.group, axis_k=self.axis, axis_v=self.axis, rotation=self.rotation,
                           sinks=self.sinks, window=self.window)
        return RankPlan.uniform(model, keep=self.keep, **options)

    def inputs(self):
        """Token ids [batch, prompt + steps] and their attention mask (the first row left-padded)."""
        generator = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(3, zoo.VOCAB, (self.batch, self.prompt + self.steps), generator=generator)
        mask = torch.ones_like(ids)
        ids[0, :self.padding], mask[0, :self.padding] = 0, 0
        return ids, mask


# -- mutations of the traced graph that keep its meaning ------------------------------------------------------

def _tensor(node):
    value = node.meta.get("example_value") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _redirect(node: Node, new: Node) -> None:
    """Make every user of `node` (but `new`) read `new`."""
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)


def _no_ops(gm: GraphModule, rng: random.Random) -> int:
    """After some floating-point values: x.contiguous(), x.to(x.dtype) or x.view(x.shape)."""
    graph, done = gm.graph, 0
    for node in list(graph.nodes):
        value = _tensor(node)
        if node.op not in ("call_function", "call_method") or value is None or not value.is_floating_point() \
                or any(_writes_in_place(user) for user in node.users) or rng.random() > 0.3:
            continue
        static = all(isinstance(size, int) for size in value.shape)
        form = rng.choice(["contiguous", "to", "view"] if static else ["contiguous", "to"])
        args = {"contiguous": (node,), "to": (node, value.dtype), "view": (node, *value.shape)}[form]
        with graph.inserting_after(node):
            new = graph.call_method(form, args)
        new.meta.update(node.meta)
        _redirect(node, new)
        done += 1
    return done


def _impure(node: Node) -> bool:
    if node.op == "call_method":
        return _writes_in_place(node)
    if node.op != "call_function":
        return False
    return node.target is operator.setitem or _writes_in_place(node) or node.is_impure()


def _reorder(gm: GraphModule, rng: random.Random) -> int:
    """A random topological order: nodes move past those they do not depend on; nodes with side effects stay
    in place relative to all others (nothing moves across them)."""
    nodes = [node for node in gm.graph.nodes if node.op not in ("placeholder", "output")]
    position = {node: index for index, node in enumerate(nodes)}
    waiting = {node: {arg for arg in node.all_input_nodes if arg in position} for node in nodes}
    barrier_before = {}
    last = None
    for node in nodes:
        if last is not None:
            barrier_before[node] = last
        if _impure(node):
            for earlier in nodes[:position[node]]:
                waiting[node].add(earlier)
            last = node
    for node, barrier in barrier_before.items():
        waiting[node].add(barrier)
    order, placed = [], set()
    ready = [node for node in nodes if not waiting[node]]
    users = {node: [user for user in nodes if node in waiting[user]] for node in nodes}
    while ready:
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node)
        placed.add(node)
        for user in users[node]:
            if user not in placed and user not in ready and waiting[user] <= placed:
                ready.append(user)
    moved = sum(a is not b for a, b in zip(order, nodes))
    anchor = next(node for node in gm.graph.nodes if node.op == "output")
    for node in order:
        anchor.prepend(node)
    return moved


def _linears(gm: GraphModule):
    return [node for node in gm.graph.nodes if node.op == "call_function" and node.target in LINEAR_TARGETS
            and len(node.args) >= 2 and _tensor(node.args[1]) is not None and _tensor(node.args[1]).dim() == 2]


def _bias(node: Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _split(gm: GraphModule, rng: random.Random) -> int:
    """Some projections x W^T + b computed as cat([x W[:h]^T + b[:h], x W[h:]^T + b[h:]], -1)."""
    graph, done = gm.graph, 0
    for node in _linears(gm):
        rows = _tensor(node.args[1]).shape[0]
        if rows < 2 or rng.random() > 0.5:
            continue
        cut = rng.randrange(1, rows)
        bias = _bias(node)
        with graph.inserting_before(node):
            parts = []
            for piece in (slice(0, cut), slice(cut, rows)):
                weight = graph.call_function(operator.getitem, (node.args[1], piece))
                part_bias = None if bias is None else graph.call_function(operator.getitem, (bias, piece))
                parts.append(graph.call_function(node.target, (node.args[0], weight, part_bias)))
            whole = graph.call_function(torch.cat, (parts, -1))
        whole.meta.update(node.meta)
        node.replace_all_uses_with(whole)
        graph.erase_node(node)
        done += 1
    return done


def _fuse(gm: GraphModule, rng: random.Random) -> int:
    """Projections of one input computed as one: split(x cat(W1, W2, ...)^T + cat(b1, ...), sizes, -1)[i]."""
    graph, done = gm.graph, 0
    by_input = {}
    for node in _linears(gm):
        by_input.setdefault((node.args[0], _bias(node) is None), []).append(node)
    for (_, unbiased), group in by_input.items():
        if len(group) < 2 or rng.random() > 0.7:
            continue
        first = min(group, key=lambda node: list(graph.nodes).index(node))
        sizes = [_tensor(node.args[1]).shape[0] for node in group]
        with graph.inserting_before(first):
            weight = graph.call_function(torch.cat, ([node.args[1] for node in group], 0))
            bias = None if unbiased else graph.call_function(torch.cat, ([_bias(node) for node in group], 0))
            fused = graph.call_function(first.target, (first.args[0], weight, bias))
            split = graph.call_function(torch.split, (fused, sizes, -1))
            for index, node in enumerate(group):
                part = graph.call_function(operator.getitem, (split, index))
                part.meta.update(node.meta)
                node.replace_all_uses_with(part)
        for node in group:
            graph.erase_node(node)
        done += 1
    return done


MUTATIONS = {"no-ops": _no_ops, "reorder": _reorder, "split": _split, "fuse": _fuse}


def mutating(mutations, seed, options):
    """A backend that applies `mutations` (names of MUTATIONS) to each graph, then hands it to lrkv's."""
    def compile_graph(gm, example_inputs, **_):
        rng = random.Random(seed)
        for name in mutations:
            MUTATIONS[name](gm, rng)
        gm.graph.lint()
        gm.recompile()
        return backend.lrkv_backend(gm, example_inputs, options=options)
    return compile_graph


# -- the checks -----------------------------------------------------------------------------------------------

class Mismatch(AssertionError):
    """A fuzz case whose rewrite is not what it must equal."""


class Refused(Exception):
    """A drawn plan the planner does not accept (a PlanError building it, e.g. a scale group that does not divide
    a rank): not a case to check."""


def _compare(what, got, expected, mask, dtype):
    keep = mask.bool()
    try:
        torch.testing.assert_close(got.float()[keep], expected.float()[keep], **TOLERANCE[dtype])
    except AssertionError as error:
        raise Mismatch(f"{what}: {error}") from None


def _positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def check(case: Case) -> None:
    """Run one case; raises `Mismatch` (or the error the case hit) when the rewrite is not what it must equal,
    `Refused` when the planner does not accept the drawn plan."""
    torch._dynamo.reset()
    first_report = len(backend.reports)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. a rank rounded to whole scale groups: the numbers are checked
        warnings.filterwarnings("error", "lrkv: attention at", LrkvWarning)  # a site left untouched fails
        _run(case)
    graphs = backend.reports[first_report:]
    if not graphs:
        raise Mismatch("the backend compiled no graph")
    for sites in graphs:
        done = [site for site in sites if site.status == "rewritten"]
        if len(done) != case.layers:
            raise Mismatch(f"{len(done)} of {case.layers} attention sites rewritten: "
                           + "; ".join(f"layer {site.index}: {site.status}" for site in sites if site not in done))
    torch._dynamo.reset()


def _run(case: Case) -> None:
    from .cache import LatentCache
    from .reference import low_rank_reference, stepwise
    model = case.model()
    try:
        plan = case.plan(model)
    except PlanError as error:
        raise Refused(f"{case!r}: {error}") from error
    dtype = getattr(torch, case.dtype)
    ids, mask = case.inputs()
    forward = torch.compile(model.forward, backend=mutating(case.mutations, case.seed, {"plan": plan}))
    if case.check == "full":
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = forward(input_ids=ids, attention_mask=mask, use_cache=False).logits
        _compare("full-rank rewrite vs the original model", got, expected, mask, dtype)
    elif case.check == "truncated":
        expected = low_rank_reference(model, plan)(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = forward(input_ids=ids, attention_mask=mask, use_cache=False).logits
        _compare("truncated rewrite vs the low-rank reference", got, expected, mask, dtype)
    else:
        reference = low_rank_reference(model, plan)
        cache = LatentCache(model, plan, max_batch_size=case.batch, max_cache_len=case.prompt + case.steps + 2)
        positions = _positions(mask)
        with stepwise(reference):
            for start, end in [(0, case.prompt)] + [(t, t + 1) for t in range(case.prompt, ids.shape[1])]:
                step = dict(input_ids=ids[:, start:end], attention_mask=mask[:, :end],
                            position_ids=positions[:, start:end])
                for name in ("attention_mask",) + (("input_ids", "position_ids") if end - start > 1 else ()):
                    step[name] = step[name].clone()  # a new tensor each step, its length dynamic: two graphs in
                    torch._dynamo.maybe_mark_dynamic(step[name], 1)  # all (prefill, decode), not one per length
                got = forward(**step, **{cache_keyword(model): cache}, use_cache=True).logits
                expected = reference(input_ids=ids[:, :end], attention_mask=mask[:, :end],
                                     position_ids=positions[:, :end], use_cache=False).logits[:, start:]
                _compare(f"LatentCache tokens {start}:{end} vs the reference", got, expected,
                         mask[:, start:end], dtype)


# -- drawing cases --------------------------------------------------------------------------------------------

def cases(families=None, checks=CHECKS):
    """The hypothesis strategy of `Case`s of `families` (default: the zoo's) under `checks`; only combinations
    the families and plans accept."""
    from hypothesis import strategies as st
    families = list(families or zoo.names())
    unknown = [name for name in families if name not in zoo.FAMILIES] + [kind for kind in checks if kind not in CHECKS]
    if unknown:
        raise ValueError(f"lrkv fuzz: unknown {unknown}; families: {zoo.names()}, checks: {list(CHECKS)}")

    @st.composite
    def draw_case(draw):
        family_name = draw(st.sampled_from(families))
        family = zoo.FAMILIES[family_name]
        check_kind = draw(st.sampled_from(list(checks)))
        kv_heads = draw(st.sampled_from([1, 2, 4]))
        ratio = draw(st.sampled_from([1, 2, 3, 4])) if family.kv_heads else 1
        dtype = draw(st.sampled_from(["float32", "bfloat16"]))
        keep, bits = 1.0, 16
        if check_kind != "full":
            keep = draw(st.sampled_from([0.25, 0.5, 0.75, 1.0]))
            bits = draw(st.sampled_from([16, 8, 4, 3, 2])) if check_kind == "decode" else 16
        quantized = bits != 16
        if quantized:
            dtype = "float32"  # bf16 rounding moves values across quantization steps: no tolerance holds
        batch = draw(st.integers(1, 3))
        prompt = draw(st.integers(1, 8))
        axis = draw(st.sampled_from(["token", "channel"])) if quantized else "token"
        # per-channel scales span a block of tokens, and a left-padded row's block holds its padding's latents,
        # which the stock model and the latent cache compute differently (both arbitrary): not drawn together
        padded = batch > 1 and axis == "token"
        return Case(
            family=family_name, check=check_kind, layers=draw(st.integers(1, 2)), kv_heads=kv_heads, ratio=ratio,
            head_dim=draw(st.sampled_from([8, 16, 32])), dtype=dtype,
            attention=draw(st.sampled_from(["", "eager"])) if family.attention == "sdpa" else "",
            rope=draw(st.sampled_from(["", *ROPE_SCALING])) if family_name in ROPE_SCALED else "",
            sliding_window=draw(st.sampled_from([0, 2, 5])) if family_name in SLIDING else 0,
            keep=keep, scheme=draw(st.sampled_from(["head", "joint", "hybrid"] + ["group"] * (kv_heads > 1))),
            bits=bits,
            group=draw(st.sampled_from([4, 8, 16])) if quantized else 8,
            axis=axis,
            rotation=draw(st.sampled_from(["none", "hadamard"])) if quantized else "none",
            sinks=draw(st.sampled_from([0, 2])) if quantized else 0,
            window=draw(st.sampled_from([0, 3])) if quantized else 0,
            batch=batch, padding=draw(st.integers(0, prompt - 1)) if padded else 0, prompt=prompt,
            steps=draw(st.integers(1, 4)) if check_kind == "decode" else 0,
            mutations=tuple(draw(st.lists(st.sampled_from(sorted(MUTATIONS)), unique=True, max_size=4))),
            seed=draw(st.integers(0, 255)))
    return draw_case()


def fuzz(examples: int = 100, seed: int = 0, families=None, checks=CHECKS, shrink_seconds: float = 300,
         show: bool = True) -> dict:
    """Run `examples` cases drawn from `seed` (of `families` under `checks`, as `cases`); a failure is shrunk for
    at most `shrink_seconds` (hypothesis's own limit is 300). Returns a summary: counts per family, check and
    mutation, the plans the planner refused (drawn combinations it does not accept, e.g. a scale group that does
    not divide a rank), and on a failure the first failing case found, the shrunk one, its error and its
    reproducer."""
    from unittest import mock
    from hypothesis import HealthCheck, given, reject, seed as hypothesis_seed, settings
    from hypothesis.internal.conjecture import engine
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table
    console = Console(quiet=not show)
    families = list(families or zoo.names())
    ran, refused, failed = Counter(), Counter(), {}

    def run(case):
        try:
            check(case)
        except Refused:
            refused[case.family] += 1
            reject()
        except BaseException as error:
            failed.setdefault("found", case)
            failed.update(case=case, error=error)
            raise
        finally:
            progress.advance(task)
        ran[("family", case.family)] += 1
        ran[("check", case.check)] += 1
        for name in case.mutations:
            ran[("mutation", name)] += 1

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("lrkv fuzz", total=examples)
        for index, family in enumerate(families):  # each family its share (hypothesis alone draws unevenly)
            share = examples // len(families) + (index < examples % len(families))
            settings_ = settings(max_examples=share, database=None, deadline=None, print_blob=False,
                                 suppress_health_check=list(HealthCheck))
            test = hypothesis_seed(seed * len(zoo.FAMILIES) + zoo.names().index(family))(
                settings_(given(case=cases([family], checks))(run)))
            try:
                with mock.patch.object(engine, "MAX_SHRINKING_SECONDS", shrink_seconds):
                    test()
            except Exception as error:  # the shrunk case is the last one that failed
                failed.setdefault("error", error)  # (else hypothesis itself failed, e.g. too many refused plans)
                break
    passed = {}
    for (kind, name), count in sorted(ran.items()):
        passed.setdefault(kind, {})[name] = count
    summary = {"examples": sum(passed.get("check", {}).values()), "seed": seed, "passed": passed,
               "refused_plans": sum(refused.values())}
    table = Table(title=f"lrkv fuzz, seed {seed}: {summary['examples']} cases passed")
    for kind in ("family", "check", "mutation"):
        table.add_column(kind)
        table.add_column("cases", justify="right")
    columns = [sorted(passed.get(kind, {}).items()) for kind in ("family", "check", "mutation")]
    for row in range(max(map(len, columns), default=0)):
        cells = []
        for column in columns:
            cells += [column[row][0], str(column[row][1])] if row < len(column) else ["", ""]
        table.add_row(*cells)
    console.print(table)
    if summary["refused_plans"]:
        console.print(f"{summary['refused_plans']} drawn plans were refused by the planner (PlanError) and redrawn")
    if failed:
        case, error = failed.get("case"), failed["error"]
        summary.update(found=repr(failed.get("found")), failure=repr(case), error=f"{type(error).__name__}: {error}",
                       reproducer=f'python -c "from lrkv_compile.fuzz import *; check({case!r})"' if case else None)
        console.print(f"[red]FAILED[/red] {case!r}\n{summary['error']}\nreproduce: {summary['reproducer']}",
                      highlight=False, soft_wrap=True)
    return summary

