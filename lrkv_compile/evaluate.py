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


@torch.no_grad()
def continuation_perplexity(forward, rows, prefix: int, make_cache, progress=True, desc="continuation") -> float:
    """The continuation protocol: prefill each row's first `prefix` tokens into a fresh cache
    (`make_cache(row_length)`), then score the rest of the row in one forward through that cache.
    Returns exp(mean NLL) over the continuation tokens, so only the cache's damage to the prefix shows."""
    total_nll, total_tokens = 0.0, 0
    for row in tqdm(rows, desc=desc, disable=not progress, unit="row"):
        ids = row[None] if row.dim() == 1 else row
        if not 0 < prefix < ids.shape[1] - 1:
            raise ValueError(f"prefix={prefix} must leave at least two of the row's {ids.shape[1]} tokens to score")
        cache = make_cache(ids.shape[1])
        first = forward(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True).logits[:, -1:]
        rest = forward(input_ids=ids[:, prefix:], past_key_values=cache, use_cache=True).logits[:, :-1]
        logits = torch.cat((first, rest), dim=1).float()
        total_nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, prefix:].flatten(),
                                                             reduction="sum"))
        total_tokens += ids[:, prefix:].numel()
    return math.exp(total_nll / total_tokens)


def quantized_cache_fraction(nbits: int, group: int) -> float:
    """Bytes of transformers' QuantizedCache (quanto) per 16-bit K/V byte, its full-precision residual window
    left out: nbits per value plus an fp16 scale and zero point per group."""
    return nbits / 16 + 2 * 2 / (2 * group)


def passkey_prompts(tokenizer, haystack: str, count: int, context: int, seed: int = 0) -> list:
    """`count` (prompt ids [1, tokens], key) pairs for the passkey test: a random 5-digit key stated once at a
    random depth of about `context` tokens of real `haystack` text, then asked for at the end."""
    import random
    rng = random.Random(seed)
    ids = tokenizer(haystack, return_tensors="pt").input_ids[0]

    def encode(text):
        return tokenizer(text, return_tensors="pt").input_ids[0]

    head = encode("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.")
    question = encode(" What is the pass key? The pass key is")
    prompts = []
    for _ in range(count):
        key = str(rng.randint(10000, 99999))
        needle = encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        filler = context - len(head) - len(needle) - len(question)
        if filler < 1 or len(ids) < filler:
            raise ValueError(f"context={context} tokens is too short for the passkey prompt, or the text too short")
        start = rng.randint(0, len(ids) - filler)
        depth = rng.randint(0, filler)
        hay = ids[start:start + filler]
        prompts.append((torch.cat((head, hay[:depth], needle, hay[depth:], question))[None], key))
    return prompts


@torch.no_grad()
def passkeys_retrieved(generate, tokenizer, prompts, progress=True, desc="passkey") -> int:
    """How many of the prompts' keys `generate(ids, max_new_tokens=...)` (greedy) answers."""
    found = 0
    for ids, key in tqdm(prompts, desc=desc, disable=not progress, unit="prompt"):
        out = generate(ids, max_new_tokens=8, do_sample=False)
        found += key in tokenizer.decode(out[0, ids.shape[1]:])
    return found
