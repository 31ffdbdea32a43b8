"""Hypothesis strategies, and the tolerance table every numerical test uses (the fuzzer's)."""
import torch
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from lrkv_compile.fuzz import TOLERANCE  # noqa: F401  (the one table, shared with the fuzzer)

VOCAB = 61


@st.composite
def model_configs(draw, dtypes=(torch.float32, torch.bfloat16)):
    """Small Llama-family attention shapes: heads, GQA ratio, head_dim, hidden size, bias, dtype."""
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    return dict(
        num_key_value_heads=kv_heads, num_attention_heads=kv_heads * group, head_dim=head_dim,
        hidden_size=kv_heads * group * draw(st.sampled_from([4, 8, 16])), attention_bias=draw(st.booleans()),
        num_hidden_layers=draw(st.integers(1, 2)), dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**16)),
    )


def build_model(spec) -> LlamaForCausalLM:
    spec = dict(spec)
    dtype, seed = spec.pop("dtype"), spec.pop("seed")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, intermediate_size=64, max_position_embeddings=512, **spec)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    if spec.get("attention_bias"):
        with torch.no_grad():  # transformers initialises biases to zero; make them matter
            for name, param in model.named_parameters():
                if name.endswith("proj.bias"):
                    param.normal_(0, 0.5)
    return model.to(dtype)
