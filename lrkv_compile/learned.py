"""Learned ranks: STAR-KV's soft thresholds on the singular values, trained by knowledge distillation.

STAR-KV (Low-Rank KV Cache Compression via Soft Thresholding for Adaptive Rank Control, Sec. 4.1.2-4.2)
factors every K/V projection by SVD and cuts its spectrum at a threshold alpha: the singular values
sigma >= alpha are kept, the others dropped, so the threshold sets the rank. A hard cut has no gradient,
so during training it is relaxed to a smooth mask and alpha is learned with a knowledge-distillation loss
(KL of the compressed model's next-token distribution to the original's) plus a compression loss.

What this module learns, per (site, side): one threshold alpha over the latent channels of the whitened
full-rank factorization `factorize(W, whitening_factor(G / tokens), blocks, full)`. The factors are
frozen; only the thresholds train. Details:

- Spectrum: channel j of a factorization with several blocks (head-wise K) has one singular value per
  block; their geometric mean sigma_j (decreasing in j; floored at 1e-6 sigma_0) is what the threshold
  cuts, so every block keeps the same number of channels, as `factorize` splits a rank evenly over blocks.
- Threshold: alpha is stored as its depth in the spectrum's log range,
  log alpha = log sigma_0 - theta * (log sigma_0 - log sigma_last), so that one learning rate and one
  temperature suit every layer (whitened spectra differ by orders of magnitude between layers).
- Soft threshold: channel j is scaled by mask_j = sigmoid((log sigma_j - log alpha) / (tau * range)),
  i.e. sigmoid((theta - u_j) / tau) with u_j the channel's depth; tau is annealed geometrically from
  `tau_start` to `tau_end`, so the mask tends to the hard cut 1{sigma_j >= alpha}. (STAR-KV's operator is
  sigma * tanh(s (sigma - alpha)) above alpha, 0 below; the sigmoid is the same idea in log-sigma, with
  a gradient on both sides of the threshold.)
- Loss: KL(teacher || student) per token + gamma * ((E[R] - R) / R)^2, with E[R] = sum over sides of
  blocks * sum_j mask_j the expected total rank and R = `total_rank`. The paper's compression loss,
  sum_i exp(-alpha_i), has no target; a budget needs one. Thresholds start at the uniform split of R.
- Reading the rank off: rank = blocks * #{j : sigma_j >= alpha} (the hard threshold), rounded to the
  nearest allowed rank; then, while the sum exceeds R, the step down whose dropped channels lie deepest
  below their threshold is taken, and while rank is left, the step up whose added channels lie closest
  to (or above) their threshold. The learned margin theta - u_j is the score.

The projections are applied by replacing each k_proj / v_proj module's forward for the duration of the
call with x -> ((x @ down) * mask) @ up (+ bias); the model (forwards, training mode, requires_grad) is
restored exactly afterwards, also on error. Rows are cut into chunks of `length` tokens; each step runs
the student forward and backward on one chunk, against the teacher's probabilities computed once per
chunk without grad and kept in float16 (2 bytes per token per vocabulary entry: 200 MB for SmolLM2's
2048 calibration tokens). SmolLM2-135M, 4 rows of 512 tokens, default options, 1 CPU thread: about 85 s.
"""
import torch
from tqdm.auto import tqdm

from lrkv_compile.passes.factorize import factorize, whitening_factor
from .weights import ProjectionWeights

DEFAULTS = dict(
    steps=24,          # optimizer steps, one calibration chunk each (3 passes over 4 rows of 512 tokens)
    length=256,        # rows are cut into chunks of at most this many tokens
    lr=0.06,           # Adam, in units of a spectrum's log range (theta)
    tau_start=0.05,    # temperature of the mask at the first step (theta units) ...
    tau_end=0.005,     # ... and at the last, annealed geometrically
    gamma=10.0,        # weight of the squared relative excess of the expected total rank
    seed=0,            # order in which the chunks are visited
)


def _spectrum(down, whitening, blocks):
    """Depth u_j in [0, 1] of each channel j of one block in the log-spectrum (0 = largest singular value)."""
    singular = (whitening.T @ down.double()).norm(dim=0).view(blocks, -1)  # S^T down = V_r Sigma_r
    singular = singular.clamp_min(singular.max() * 1e-6).log().mean(0)     # geometric mean over blocks
    span = (singular[0] - singular[-1]).clamp_min(1e-6)
    return ((singular[0] - singular) / span).float()


def _initial_theta(depth, keep):
    """The threshold between the `keep`-th and next channel: the hard cut keeps exactly `keep` per block."""
    if keep <= 0:
        return float(depth[0]) - 0.05
    if keep >= len(depth):
        return float(depth[-1]) + 0.05
    return float(depth[keep - 1] + depth[keep]) / 2


def _teacher(model, chunks):
    """Per chunk: the original model's next-token probabilities (float16, 2 bytes per token and vocabulary
    entry) and sum p log p (for the KL's value)."""
    targets = {}
    with torch.no_grad():
        for index, chunk in chunks.items():
            logp = torch.log_softmax(model(input_ids=chunk, use_cache=False).logits.float(), -1)
            targets[index] = (logp.exp().half(), float((logp.exp() * logp).sum()))
    return targets


def _read_off(keys, blocks, choices, depth, theta, total_rank):
    """{key: rank}: the hard threshold's rank, rounded to an allowed one, then repaired to fit total_rank."""
    def score(key, low, high):  # mean learned margin of the channels between ranks low and high
        section = depth[key][low // blocks[key]:high // blocks[key]]
        return float(theta[key] - section.mean()) if len(section) else 0.0

    ranks = {}
    for key in keys:
        hard = blocks[key] * int((depth[key] <= theta[key]).sum())
        ranks[key] = min(choices[key], key=lambda rank: (abs(rank - hard), rank))
    while sum(ranks.values()) > total_rank:  # drop the channels the thresholds wanted least
        moves = [(score(key, lower, ranks[key]), key, lower) for key in keys
                 for lower in [max((r for r in choices[key] if r < ranks[key]), default=None)] if lower is not None]
        _, key, lower = min(moves, key=lambda move: move[0])
        ranks[key] = lower
    while True:  # spend what is left where the thresholds wanted more
        left = total_rank - sum(ranks.values())
        moves = [(score(key, ranks[key], upper), key, upper) for key in keys
                 for upper in [min((r for r in choices[key] if r > ranks[key]), default=None)]
                 if upper is not None and upper - ranks[key] <= left]
        if not moves:
            return ranks
        _, key, upper = max(moves, key=lambda move: move[0])
        ranks[key] = upper


def learn_ranks(model, batches, stats, blocks: dict, choices: dict, total_rank: int, steps: int = DEFAULTS["steps"],
                progress: bool = True, **hyper) -> dict:
    """{(site_index, side): rank} learned with STAR-KV soft thresholds (see the module docstring).

    batches: the calibration token ids (as `collect_stats` takes them); stats: `collect_stats(model, ...)`;
    blocks[(site, side)]: factor blocks of that side ("k" or "v"); choices[(site, side)]: its allowed
    ranks, sorted multiples of its blocks; total_rank: the most the ranks may sum to. Every rank is one of
    its choices and the sum is at most total_rank. hyper: any of DEFAULTS but steps (length, lr,
    tau_start, tau_end, gamma, seed). Deterministic for a given seed.
    """
    from .calibrate import as_batches  # here, not at the top: calibrate.py is to import this module

    unknown = set(hyper) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"learn_ranks got unknown options {sorted(unknown)}; it takes {sorted(DEFAULTS)}")
    options = {**DEFAULTS, **hyper, "steps": steps}
    keys = sorted(choices)
    if sorted(blocks) != keys:
        raise ValueError("blocks and choices must name the same (site, side) keys")
    for key in keys:
        if not choices[key] or list(choices[key]) != sorted(choices[key]) or any(r % blocks[key] for r in choices[key]):
            raise ValueError(f"choices[{key}] = {choices[key]} must be sorted multiples of its {blocks[key]} blocks")
    lowest = sum(choices[key][0] for key in keys)
    if total_rank < lowest:
        raise ValueError(f"total_rank={total_rank} is below the smallest allowed ranks' sum, {lowest}")

    device = next(model.parameters()).device
    params = ProjectionWeights(model)
    sites = {site.index: site for site in stats.sites}
    factors, depth = {}, {}
    for key in keys:
        site = sites[key[0]]
        name = site.k_weight if key[1] == "k" else site.v_weight
        weight = params[name].detach().float().cpu()
        whitening = whitening_factor(stats.grams[site.index] / stats.tokens)
        full = blocks[key] * min(weight.shape[0] // blocks[key], weight.shape[1])
        if choices[key][-1] > full:
            raise ValueError(f"choices[{key}] go up to {choices[key][-1]}, above its full rank {full}")
        down, up = factorize(weight, whitening, blocks[key], full)
        depth[key] = _spectrum(down, whitening, blocks[key])
        factors[key] = (name.removesuffix(".weight"), down.to(device), up.to(device))
    full_total = sum(blocks[key] * len(depth[key]) for key in keys)
    share = min(1.0, total_rank / full_total)  # the uniform split the thresholds start from
    theta = torch.tensor([_initial_theta(depth[key], round(share * len(depth[key]))) for key in keys],
                         requires_grad=True)
    depths = [depth[key].to(device) for key in keys]
    scale = torch.tensor([float(blocks[key]) for key in keys])
    tau = torch.tensor(0.0)  # the current temperature, read by the replaced forwards

    def masks():
        return [torch.sigmoid((theta[i] - depths[i]) / tau) for i in range(len(keys))]

    current = {}  # key -> mask of this step's forward pass

    def compressed(key, bias):
        down, up = factors[key][1:]

        def forward(x):
            mask = current[key].repeat(blocks[key])
            y = ((x.float() @ down) * mask) @ up
            return (y if bias is None else y + bias.float()).to(x.dtype)
        return forward

    rows = [row[None].to(device) for batch in as_batches(batches) for row in batch]
    chunks = [piece for row in rows for piece in row.split(options["length"], dim=1) if piece.shape[1] >= 2]
    generator = torch.Generator().manual_seed(options["seed"])
    order = [int(i) for _ in range(-(-steps // len(chunks))) for i in torch.randperm(len(chunks), generator=generator)]
    order = order[:steps]  # each step one chunk, every chunk once per pass, in a seeded order

    modules = {key: model.get_submodule(factors[key][0]) for key in keys}
    saved_forwards = {key: module.__dict__.get("forward") for key, module in modules.items()}
    saved_grad = {name: param.requires_grad for name, param in params.items()}
    was_training = model.training
    try:
        model.eval()
        for param in params.values():
            param.requires_grad_(False)
        targets = _teacher(model, {index: chunks[index] for index in sorted(set(order))})
        for key, module in modules.items():
            module.forward = compressed(key, getattr(module, "bias", None))
        optimizer = torch.optim.Adam([theta], lr=options["lr"])
        bar = tqdm(range(steps), desc="lrkv learn ranks (STAR-KV)", disable=not progress, unit="step")
        for step in bar:
            fraction = step / max(1, steps - 1)
            tau.fill_(options["tau_start"] * (options["tau_end"] / options["tau_start"]) ** fraction)
            current.update(zip(keys, masks()))
            chunk = chunks[order[step]]
            probs, negentropy = targets[order[step]]
            logp = torch.log_softmax(model(input_ids=chunk, use_cache=False).logits.float(), -1)
            positions = chunk.shape[1]
            kl = (negentropy - (probs.float() * logp).sum()) / positions
            expected = sum(scale[i] * current[key].sum().cpu() for i, key in enumerate(keys))
            penalty = options["gamma"] * ((expected - total_rank) / max(total_rank, 1)) ** 2
            optimizer.zero_grad()
            (kl.cpu() + penalty).backward()
            optimizer.step()
            bar.set_postfix(kl=f"{kl.item():.4f}", rank=f"{expected.item():.0f}/{total_rank}")
    finally:
        for key, module in modules.items():
            if saved_forwards[key] is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved_forwards[key]
        for name, param in params.items():
            param.requires_grad_(saved_grad[name])
        model.train(was_training)
    learned = theta.detach()
    return _read_off(keys, blocks, choices, depth, {key: float(learned[i]) for i, key in enumerate(keys)}, total_rank)
