"""Perplexity of a model (compiled with a plan, or not) on token batches."""
import math

import torch
from tqdm.auto import tqdm

from .trace import private_forward


@torch.no_grad()
def perplexity(forward, batches, progress=True) -> float:
    """exp(mean next-token negative log-likelihood) of `forward(input_ids=..., use_cache=False)` over the rows."""
    total_nll, total_tokens = 0.0, 0
    for row in tqdm(batches, desc="perplexity", disable=not progress, unit="row"):
        ids = row[None] if row.dim() == 1 else row
        logits = forward(input_ids=ids, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        total_nll += float(nll)
        total_tokens += ids[:, 1:].numel()
    return math.exp(total_nll / total_tokens)


def compiled_forward(model, plan):
    """The model's forward compiled with the lrkv backend under `plan`, on a private copy of its code, so
    that scoring many plans never exhausts Dynamo's recompile limit (see `lrkv_compile.trace`)."""
    return torch.compile(private_forward(model), backend="lrkv", fullgraph=True, options={"plan": plan})
