"""Random-weight models of the decoder architectures lrkv knows, built from transformers configs (no download).

One table: what each family is made of (its config class and how the common dimensions map onto it) and what
lrkv does with its attention. The architecture tests, the fuzzer and the README's matrix read it.

    model = zoo.build("qwen3", layers=2, heads=4, kv_heads=2, head_dim=16)
"""
from dataclasses import dataclass, field
from typing import Callable

import torch
import transformers

VOCAB = 97


@dataclass(frozen=True)
class Family:
    name: str
    config: str                      # the transformers config class
    dims: Callable[..., dict]        # (layers, hidden, heads, kv_heads, head_dim) -> config keyword arguments
    rewritten: str                   # what lrkv does with its attention sites (the README's matrix)
    extra: dict = field(default_factory=dict)
    kv_heads: bool = True            # the family has grouped-query attention (else kv_heads = heads)
    bias_names: tuple = ("proj.bias",)  # endings of the parameter names drawn at random (biases, norm weights)
    attention: str = "sdpa"          # the attention implementation transformers supports for it
    head_dim: bool = True            # head_dim is a setting of its own (else hidden / heads)


def _llama_like(layers, hidden, heads, kv_heads, head_dim):
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=2 * hidden)


def _phi3(layers, hidden, heads, kv_heads, head_dim):
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=2 * hidden)


def _gpt_neox(layers, hidden, heads, kv_heads, head_dim):
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=2 * hidden)


def _gpt2(layers, hidden, heads, kv_heads, head_dim):
    return dict(n_layer=layers, n_embd=hidden, n_head=heads, n_inner=2 * hidden)


def _gptj(layers, hidden, heads, kv_heads, head_dim):
    return dict(n_layer=layers, n_embd=hidden, n_head=heads, n_inner=2 * hidden, rotary_dim=head_dim // 2)


FAMILIES = {family.name: family for family in (
    Family("llama", "LlamaConfig", _llama_like, "K/V factored, latent cache", {"attention_bias": True}),
    Family("mistral", "MistralConfig", _llama_like, "K/V factored, latent cache; sliding-window layers in a latent ring of window size",
           {"sliding_window": 8}),
    Family("mixtral", "MixtralConfig", _llama_like, "K/V factored, latent cache; sliding-window layers in a latent ring of window size",
           {"sliding_window": 8, "num_local_experts": 2, "num_experts_per_tok": 1}),
    Family("qwen2", "Qwen2Config", _llama_like, "K/V factored (with bias), latent cache"),
    Family("qwen3", "Qwen3Config", _llama_like, "K/V factored, latent cache; the per-head key norm is applied to "
           "the rebuilt keys", bias_names=("proj.bias", "norm.weight")),
    Family("gemma3", "Gemma3TextConfig", _llama_like, "K/V factored, latent cache; key norm (1 + weight) on the "
           "rebuilt keys; sliding-window layers in latent rings, global layers full length",
           {"sliding_window": 4, "layer_types": None, "sliding_window_pattern": 2}, bias_names=("norm.weight",)),
    # a cap and a query scale at which the soft-capping changes the logits of a random model
    Family("gemma2", "Gemma2Config", _llama_like, "K/V factored, latent cache; eager attention with soft-capped "
           "scores; sliding-window layers in latent rings, global layers full length",
           {"sliding_window": 4, "attn_logit_softcapping": 0.05, "query_pre_attn_scalar": 1}, attention="eager"),
    Family("stablelm", "StableLmConfig", _llama_like, "K/V factored, latent cache; partial RoPE on the rebuilt "
           "keys", {"partial_rotary_factor": 0.25, "use_qkv_bias": True}),
    Family("phi", "PhiConfig", _llama_like, "K/V factored (with bias), latent cache; partial RoPE on the rebuilt "
           "keys", {"partial_rotary_factor": 0.5}),
    Family("phi3", "Phi3Config", _phi3, "fused qkv projection: its K and V rows factored, latent cache",
           {"partial_rotary_factor": 1.0}, head_dim=False),
    Family("gpt_neox", "GPTNeoXConfig", _gpt_neox, "fused qkv projection interleaved per head: its K and V rows "
           "factored, latent cache; partial RoPE on the rebuilt keys", {"rotary_pct": 0.25},
           kv_heads=False, head_dim=False, bias_names=("query_key_value.bias",)),
    Family("gpt2", "GPT2Config", _gpt2, "fused Conv1D qkv projection: its K and V columns factored, latent cache "
           "(no RoPE: scores in latent space)", kv_heads=False, head_dim=False, bias_names=("c_attn.bias",)),
    Family("gptj", "GPTJConfig", _gptj, "K/V factored, latent cache; interleaved partial RoPE, read from its "
           "sin/cos table, on the rebuilt keys (channels permuted into rotate-half order)", kv_heads=False,
           head_dim=False, attention="eager"),
    Family("opt", "OPTConfig",
           lambda layers, hidden, heads, kv_heads, head_dim: dict(
               num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_dim=2 * hidden,
               word_embed_proj_dim=hidden),
           "K/V factored (with bias), latent cache (no RoPE: scores in latent space)", kv_heads=False),
)}


def names() -> list[str]:
    return list(FAMILIES)


def build(name: str, layers: int = 2, hidden: int | None = None, heads: int = 4, kv_heads: int = 2,
          head_dim: int = 16, dtype=torch.float32, seed: int = 0, attention: str | None = None, **overrides):
    """A random-weight `name` model in eval mode with `attention` ("sdpa" or "eager"; default: the family's, SDPA
    where transformers supports it); biases and q/k norm weights (where the
    family has them) drawn at random, so they matter (transformers initialises them to zero or one). `hidden` defaults to heads * head_dim; families without grouped-query attention
    use kv_heads = heads, and those without a head_dim setting hidden = heads * head_dim."""
    family = FAMILIES[name]
    if not family.kv_heads:
        kv_heads = heads
    if not family.head_dim and hidden is not None and hidden != heads * head_dim:
        raise ValueError(f"{name}: head_dim is hidden / heads")
    hidden = hidden or heads * head_dim
    config = getattr(transformers, family.config)(**{
        "vocab_size": VOCAB, "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        **family.dims(layers, hidden, heads, kv_heads, head_dim), **family.extra, **overrides})
    config._attn_implementation = attention or family.attention
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith(family.bias_names) and parameter.dim() == 1:
                parameter.normal_(0, 0.5)
    return model.to(dtype)
