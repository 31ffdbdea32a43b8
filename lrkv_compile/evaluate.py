"""Perplexity of a model (compiled with a plan, or not) on token batches."""
import math

import torch
from tqdm.auto import tqdm

from .compiled import CompiledModel
from .trace import cache_keyword, private_forward


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


def _keyword(forward) -> str:
    """The cache keyword of `forward`: a model, or its `lrkv.compile`."""
    return cache_keyword(forward.model if isinstance(forward, CompiledModel) else forward)


@torch.no_grad()
def cached_perplexity(forward, rows, prefix: int, make_cache, progress=True, desc="perplexity") -> float:
    """Perplexity of `forward` (a model, or its `lrkv.compile`) through a cache. prefix > 0, the continuation
    protocol: prefill each row's first `prefix` tokens into a fresh cache (`make_cache(row_length)`), then score the
    rest of the row in one forward through that cache, so what the cache stored of the prefix shows. prefix 0: one
    forward over the whole row into a fresh cache (full-sequence perplexity; every token attends to the row as this
    step computed it, so a cache's storage does not show, only changes to the model such as low-rank keys).
    Returns exp(mean NLL) over the scored tokens."""
    total_nll, total_tokens = 0.0, 0
    keyword = _keyword(forward)
    for row in tqdm(rows, desc=desc, disable=not progress, unit="row"):
        ids = row[None] if row.dim() == 1 else row
        if not 0 <= prefix < ids.shape[1] - 1:
            raise ValueError(f"prefix={prefix} must leave at least two of the row's {ids.shape[1]} tokens to score")
        cached = {keyword: make_cache(ids.shape[1]), "use_cache": True}
        if prefix:
            first = forward(input_ids=ids[:, :prefix], **cached).logits[:, -1:]
            rest = forward(input_ids=ids[:, prefix:], **cached).logits[:, :-1]
            logits, targets = torch.cat((first, rest), dim=1), ids[:, prefix:]
        else:
            logits, targets = forward(input_ids=ids, **cached).logits[:, :-1], ids[:, 1:]
        total_nll += float(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                             reduction="sum"))
        total_tokens += targets.numel()
    return math.exp(total_nll / total_tokens)


def quantized_cache_fraction(nbits: int, group: int) -> float:
    """Bytes of transformers' QuantizedCache (quanto) per 16-bit K/V byte, its full-precision residual window
    left out: nbits per value plus an fp16 scale and zero point per group."""
    return nbits / 16 + 2 * 2 / (2 * group)


def passkey_prompts(tokenizer, haystack, count: int, contexts, seed: int = 0) -> list:
    """`count` (prompt ids [1, tokens], key, context, depth) tuples for the passkey test: a random 5-digit key
    stated once inside about `context` tokens of real text (`haystack` token ids), then asked for at the end.
    The prompts are spread evenly over `contexts` (token lengths) and, within each, over depths from the
    start of the text to its end."""
    import random
    rng = random.Random(seed)

    def encode(text):
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]

    head = encode("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.")
    question = encode(" What is the pass key? The pass key is")
    per_context = [count // len(contexts) + (index < count % len(contexts)) for index in range(len(contexts))]
    prompts = []
    for context, number in zip(contexts, per_context):
        for index in range(number):
            key = str(rng.randint(10000, 99999))
            needle = encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
            filler = context - len(head) - len(needle) - len(question)
            if filler < 1 or len(haystack) < filler:
                raise ValueError(f"a passkey prompt of {context} tokens needs {max(filler, 1)} tokens of text to hide "
                                 f"the key in; the evaluation text has {len(haystack)}")
            start = rng.randint(0, len(haystack) - filler)
            depth = (index + 0.5) / number
            hay = haystack[start:start + filler]
            cut = round(depth * filler)
            prompts.append((torch.cat((head, hay[:cut], needle, hay[cut:], question))[None], key, context, depth))
    return prompts


ANSWER_TOKENS = 8  # tokens decoded after a passkey prompt


@torch.no_grad()
def greedy(forward, ids, cache, tokens: int) -> torch.Tensor:
    """`tokens` greedy tokens after `ids` [1, length] from `forward` (a model, or its `lrkv.compile`) through `cache`:
    the prompt in one forward, then a token a forward, each call as `cached_perplexity` makes them (the ids, the cache,
    use_cache), so a compiled model runs the same two graphs for both (generate() passes more arguments, each set
    compiling graphs of its own: about 30 s each on a CPU for SmolLM2)."""
    keyword = _keyword(forward)
    out = []
    logits = forward(input_ids=ids, **{keyword: cache}, use_cache=True).logits
    for _ in range(tokens):
        out.append(logits[:, -1:].argmax(-1))
        if len(out) < tokens:
            logits = forward(input_ids=out[-1], **{keyword: cache}, use_cache=True).logits
    return torch.cat(out, dim=1)


@torch.no_grad()
def passkeys_retrieved(forward, make_cache, tokenizer, prompts, progress=True, desc="passkey") -> list:
    """Per prompt, whether `forward`'s greedy answer (ANSWER_TOKENS tokens through `make_cache(prompt + answer
    length)`) holds its key."""
    found = []
    for ids, key, *_ in tqdm(prompts, desc=desc, disable=not progress, unit="prompt"):
        answer = greedy(forward, ids, make_cache(ids.shape[1] + ANSWER_TOKENS), ANSWER_TOKENS)
        found.append(key in tokenizer.decode(answer[0]))
    return found
