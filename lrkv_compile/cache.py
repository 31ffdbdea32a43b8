"""LatentCache: a transformers Cache that holds only K/V latents (and the RoPE rows of their positions).

Under the lrkv backend each attention site writes [batch, tokens, rank] latents into preallocated
buffers and attends over them directly; no full-size key or value tensor is ever stored. Its
`update` calls an opaque marker op that the backend replaces: used without the backend it raises.
"""
import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from lrkv_compile.lowering import ops
from .errors import LrkvWarning, PlanMismatchError
from .fit import check_parameters, model_layers
from .plan import RankPlan


class LatentLayer(CacheLayerMixin):
    """One layer's latent buffers. `keys`/`values` alias the latent buffers so transformers' generic
    reset/reorder code works on them."""

    is_compileable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, latent_k, latent_v, rope_cos, rope_sin, layer_idx):
        super().__init__()
        self.keys, self.values = latent_k, latent_v          # [max_batch, max_cache_len, rank]
        self.rope_cos, self.rope_sin = rope_cos, rope_sin    # shared by the layers of one RoPE group
        self.max_cache_len = latent_k.shape[1]
        self.batch_size = latent_k.shape[0]
        self.layer_idx = layer_idx
        self.cumulative_length = torch.zeros((), dtype=torch.long, device=latent_k.device)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = ops.cache_marker(key_states, value_states, self.keys, self.values, self.rope_cos,
                                        self.rope_sin, self.cumulative_length, self.layer_idx)
        self.cumulative_length.add_(key_states.shape[-2])
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len


class LatentCache(Cache):
    """Preallocated latent KV cache for `model` under `plan`.

    nbytes() is what the buffers occupy: max_batch_size x max_cache_len x (rank_k + rank_v) per layer,
    plus one [max_batch_size, max_cache_len, head_dim] cos and sin table per RoPE group.
    """

    def __init__(self, model, plan: RankPlan, max_batch_size: int = 1, max_cache_len: int = 2048,
                 dtype: torch.dtype | None = None, device=None):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} must be an integer >= 1")
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len={max_cache_len!r} must be an integer >= 1")
        check_parameters(plan, model)
        model_layer_count = model_layers(model)
        if len(plan.sites) != model_layer_count:
            raise PlanMismatchError(
                f"the plan covers layers 0-{len(plan.sites) - 1} of the model's {model_layer_count}; a LatentCache "
                f"stores latents for every layer, so it needs a plan for all {model_layer_count} (a partial plan "
                "runs only with a stock cache, which does not reduce memory)")
        reference = model.get_parameter(plan.sites[0].k_weight)
        dtype = dtype or reference.dtype
        device = device or reference.device
        tables = {}
        for site in plan.sites:
            if site.rope_group not in tables:
                shape = (max_batch_size, max_cache_len, site.head_dim)
                tables[site.rope_group] = (torch.zeros(shape, dtype=dtype, device=device),
                                           torch.zeros(shape, dtype=dtype, device=device))
        layers = []
        for site in plan.sites:
            latent_k = torch.zeros(max_batch_size, max_cache_len, site.rank_k, dtype=dtype, device=device)
            latent_v = torch.zeros(max_batch_size, max_cache_len, site.rank_v, dtype=dtype, device=device)
            layers.append(LatentLayer(latent_k, latent_v, *tables[site.rope_group], site.layer))
        super().__init__(layers=layers)
        self.plan = plan
        self.rope_tables = list(tables.values())
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len
        ratio = self.nbytes() / self.full_cache_nbytes()
        if ratio >= 1:
            warnings.warn(f"lrkv: this LatentCache takes {ratio:.2f}x the bytes of a full cache of the same capacity "
                          f"(plan keep={plan.keep:.2f}, plus one RoPE cos/sin row per slot of head_dim="
                          f"{plan.sites[0].head_dim}): it saves no memory; use a plan with a smaller keep",
                          LrkvWarning, stacklevel=2)

    def nbytes(self) -> int:
        """Bytes held by the cache's buffers (its capacity)."""
        tensors = [t for layer in self.layers for t in (layer.keys, layer.values)]
        tensors += [t for pair in self.rope_tables for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)

    def full_cache_nbytes(self) -> int:
        """Bytes a full (uncompressed) K/V cache of the same capacity and dtype would hold."""
        element = self.layers[0].keys.element_size()
        per_token = sum(2 * site.num_kv_heads * site.head_dim for site in self.plan.sites)
        return self.max_batch_size * self.max_cache_len * per_token * element
