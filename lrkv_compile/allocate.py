"""Budget allocation: which rank and layout (bits, group) each site's K and V latents get, so that the
cache takes at most a given fraction of a 16-bit cache's bytes and the model's loss grows the least.

Every method scores the same candidates. A candidate (rank, bits, group) of one site's K or V is factored
and rotated exactly as the plan will be, its latents quantized on calibration activations, and its cost
is the second-order loss estimate E[dy^T F dy], with dy the error it leaves in the projection's output and
F the Fisher matrix E[g g^T] of the loss gradient g at that output (Palu weighs rank by Fisher
information; this measures each (rank, bits) pair directly), its truncation part weighted up by
TRUNCATION_WEIGHT. Methods choose among the scored candidates:

- "search" (default): per site and side, K and V apart, the choice that minimises the summed loss under
  the budget: a Lagrangian sweep over the candidates' (bytes, loss) frontier, then a greedy fill of the
  bytes left over.
- "uniform": the same rank, bits and group for every site (K and V apart), the best such pair under the
  budget: the baseline the search is measured against.
- "fisher" (Palu's automatic rank allocation): each side's rank in proportion to its share of the Fisher
  information of the projection weights, one bit width everywhere (the best that fits).
- "learned" (STAR-KV): each side's rank from a soft threshold on its singular values trained by
  distillation (`lrkv_compile.learned`) at the total rank the search spends; bits and groups searched
  under the budget at those ranks.
"""
import math
from dataclasses import dataclass, replace

import torch

from lrkv_compile.lowering.quantize import fake_quantize
from .errors import PlanError
from .plan import Layout

# quantized widths only: their bytes do not depend on the model's dtype (16-bit sides are stored in it)
CANDIDATE_BITS = (2, 3, 4, 8)
CANDIDATE_GROUPS = (32, 48, 64, 96, 128, 192, 256)
# Per-channel scales (KIVI's keys, `Layout.axis`) are not among the candidates: with the rotation spreading
# each latent's channels, per-token scales measured better. With blocks of 32, 64 and 128 tokens added (each
# needing as many exact window slots), SmolLM2 at 512 tokens gave continuation ratios of 1.014 / 1.085 / 1.180
# at budgets 0.2 / 0.14 / 0.1 against 1.014 / 1.079 / 1.170 without them, and scoring took several times longer.
# leading latent channels (the largest singular directions) kept in float16 by a joint-scheme side's candidates
OUTLIER_CHANNELS = (8,)
# The second-order estimate counts an error's mean square, but the error a lower rank leaves is the same
# subspace dropped for every cached token, where quantization noise is independent per token; attention
# sums over tokens, so truncation costs more loss than its share of the estimate. Measured on SmolLM2
# (continuation protocol on 3 rows of the calibration text, budgets 0.1 and 0.2): weighting truncation
# 10x gives lower perplexity than 5x or 20x at both budgets, and far lower than 1x (the plain estimate).
TRUNCATION_WEIGHT = 10.0


@dataclass(frozen=True)
class Candidate:
    """One way to store one side of one site, with its measured cost."""
    rank: int
    layout: Layout
    bytes: float    # per token, as Layout.bytes_per_token counts them
    loss: float     # E[dy^T F dy] per token
    truncation: float = 0.0  # the part of it the rank alone leaves (16-bit latents of this rank)

    @property
    def cost(self) -> float:
        """What the methods minimise: the loss estimate with its truncation part weighted up (see TRUNCATION_WEIGHT)."""
        return self.loss + (TRUNCATION_WEIGHT - 1) * self.truncation


def with_exact(candidate: Candidate, sinks: int, window: int, context: int) -> Candidate:
    """The candidate with `sinks` and `window` exact tokens, its bytes counted at `context` tokens (its loss
    estimate is the fully quantized one: exact tokens only lower it)."""
    layout = replace(candidate.layout, sinks=sinks, window=window)
    return replace(candidate, layout=layout, bytes=layout.bytes_per_token(candidate.rank, context))


def candidate_ranks(full_dim: int, hidden_size: int, blocks: int) -> list[int]:
    """About sixteen ranks from small to full, multiples of 8 and of the scheme's blocks."""
    step = math.lcm(blocks, max(8, -(-full_dim // 16 // 8) * 8))
    cap = min(full_dim, hidden_size)
    ranks = list(range(step, cap + 1, step))
    return ranks if ranks and ranks[-1] == cap or cap % blocks else ranks + [cap]


def layouts_for(rank: int, rotation: str, outliers: int = 0) -> list[Layout]:
    """Each quantized width with each candidate group that divides the quantized channels (scales per token),
    `outliers` leading channels kept in float16."""
    quantized = rank - outliers
    groups = sorted({g for g in CANDIDATE_GROUPS if quantized % g == 0 and g <= quantized}
                    | ({quantized} if quantized <= 256 else set()))
    return [Layout(bits=bits, group=group, rotation=rotation, outliers=outliers)
            for bits in CANDIDATE_BITS for group in groups]


@torch.no_grad()
def score(factor, samples: torch.Tensor, outputs: torch.Tensor, fisher: torch.Tensor, ranks, rotation: str,
          outlier_options=(0,), extra=()) -> list:
    """Candidates of one side of one site. factor(rank, layout) -> (down, up) as the plan would store them;
    samples [n, hidden] calibration inputs, outputs [n, out] = samples @ W^T, fisher [out, out] per token;
    outlier_options: the numbers of leading channels kept in float16 to try (0 only for a multi-block side);
    extra: further (rank, layout) pairs to score beside that grid (any bits, axis or rotation)."""
    def fisher_loss(error):
        return float(torch.einsum("nd,de,ne->", error, fisher, error)) / len(samples)

    grid = [(rank, layouts_for(rank, rotation, outliers)) for rank in ranks
            for outliers in outlier_options if outliers < rank]
    candidates = []
    for rank, layouts in grid + [(rank, [layout]) for rank, layout in extra]:
        down, up = factor(rank, layouts[0])  # the factors depend on the rank, rotation and outliers only
        latents = samples @ down
        truncation = fisher_loss(latents @ up - outputs)
        for layout in layouts:
            restored = fake_quantize(latents, layout.bits, layout.group, layout.axis, layout.outliers)
            loss = fisher_loss(restored @ up - outputs)
            candidates.append(Candidate(rank, layout, layout.bytes_per_token(rank), loss, truncation))
    return candidates


def _frontier(candidates: list) -> list:
    """Candidates no other one beats on both bytes and loss, cheapest first."""
    frontier = []
    for candidate in sorted(candidates, key=lambda c: (c.bytes, c.cost)):
        if not frontier or candidate.cost < frontier[-1].cost:
            frontier.append(candidate)
    return frontier


def search(options: dict, budget_bytes: float) -> dict:
    """{key: Candidate} minimising the summed cost with summed bytes <= budget_bytes (options: {key: [Candidate]})."""
    frontiers = {key: _frontier(found) for key, found in options.items()}

    def pick(price):
        return {key: min(front, key=lambda c: c.cost + price * c.bytes) for key, front in frontiers.items()}

    def spent(choice):
        return sum(c.bytes for c in choice.values())

    low, high = 0.0, 1.0
    while spent(pick(high)) > budget_bytes:  # a price high enough to fit (the cheapest set fits: checked)
        high *= 4
    for _ in range(64):
        middle = (low + high) / 2
        low, high = (middle, high) if spent(pick(middle)) > budget_bytes else (low, middle)
    choice = pick(high)
    while True:  # spend what is left on the upgrades that buy the most loss per byte
        left = budget_bytes - spent(choice)
        upgrades = [((current.cost - better.cost) / (better.bytes - current.bytes), key, better)
                    for key, current in choice.items() for better in frontiers[key]
                    if current.bytes < better.bytes <= current.bytes + left and better.cost < current.cost]
        if not upgrades:
            return choice
        _, key, better = max(upgrades, key=lambda u: u[0])
        choice[key] = better


def uniform(options: dict, budget_bytes: float) -> dict:
    """The same (rank, bits, group) for every site, K and V apart: the best pair that fits."""
    def settings(side):
        by_setting = {}
        for (site, key_side), found in options.items():
            if key_side == side:
                for candidate in found:
                    setting = (candidate.rank, candidate.layout)
                    by_setting.setdefault(setting, {})[site] = candidate
        sites = {site for site, key_side in options if key_side == side}
        return [chosen for chosen in by_setting.values() if set(chosen) == sites]

    best = None
    for k_setting in settings("k"):
        k_bytes, k_loss = sum(c.bytes for c in k_setting.values()), sum(c.cost for c in k_setting.values())
        for v_setting in settings("v"):
            total = k_bytes + sum(c.bytes for c in v_setting.values())
            loss = k_loss + sum(c.cost for c in v_setting.values())
            if total <= budget_bytes and (best is None or loss < best[0]):
                best = (loss, k_setting, v_setting)
    if best is None:
        raise PlanError("no uniform setting fits the budget; use method='search', or a larger budget")
    return {**{(site, "k"): c for site, c in best[1].items()}, **{(site, "v"): c for site, c in best[2].items()}}


def fisher(options: dict, budget_bytes: float, importance: dict) -> dict:
    """Palu: ranks in proportion to each side's share of the total Fisher information `importance[key]`, rounded
    down to a candidate rank, with one bit width for every side (each side's best group for its rank); of the
    bit widths whose allocation fits, the one with the lowest summed cost."""
    total = sum(importance[key] for key in options)
    best = None
    for bits in CANDIDATE_BITS:
        by_rank = {}
        for key, found in options.items():
            for candidate in found:
                if candidate.layout.bits == bits:
                    held = by_rank.setdefault(key, {}).get(candidate.rank)
                    if held is None or candidate.cost < held.cost:
                        by_rank[key][candidate.rank] = candidate

        def pick(rank_sum, by_rank=by_rank):
            choice = {}
            for key, ranks in by_rank.items():
                target = rank_sum * importance[key] / total
                choice[key] = ranks[max((r for r in ranks if r <= target), default=min(ranks))]
            return choice

        if set(by_rank) != set(options) or sum(c.bytes for c in pick(0).values()) > budget_bytes:
            continue
        low, high = 0.0, sum(max(ranks) for ranks in by_rank.values()) * total / max(min(importance.values()), 1e-30)
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if sum(c.bytes for c in pick(middle).values()) <= budget_bytes else (low, middle)
        choice = pick(low)
        cost = sum(c.cost for c in choice.values())
        if best is None or cost < best[0]:
            best = (cost, choice)
    if best is None:
        raise PlanError("no bit width fits the budget with Fisher-proportional ranks; use method='search', or a "
                        "larger budget")
    return best[1]


def learned(options: dict, budget_bytes: float, ranks: dict) -> dict:
    """Each side at its learned rank `ranks[key]`, bits and groups chosen by `search` under the budget."""
    restricted = {key: [c for c in found if c.rank == ranks[key]] for key, found in options.items()}
    if sum(min(c.bytes for c in found) for found in restricted.values()) > budget_bytes:
        raise PlanError("the learned ranks do not fit the budget at 2 bits; use method='search', or a larger budget")
    return search(restricted, budget_bytes)


METHODS = {"search": search, "uniform": uniform, "fisher": fisher, "learned": learned}
