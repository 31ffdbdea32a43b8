"""LatentCache: a transformers Cache that holds K/V latents, quantized or not (and the positions of their
tokens, or their RoPE rows where the model recomputes its RoPE frequencies), for every layer the plan covers, and
full keys and values for the others.

Under the lrkv backend each attention site writes [batch, tokens, rank] latents into preallocated
buffers and attends over them directly; no full-size key or value tensor is ever stored. Its
`update` calls an opaque marker op that the backend replaces: used without the backend it raises.
"""
import math
import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, StaticLayer

from lrkv_compile.lowering import ops
from lrkv_compile.lowering.quantize import by_blocks, exact_dtype, stored_blocks
from .errors import LrkvWarning, PlanMismatchError, UnrewrittenSiteError
from .fit import check_parameters, model_layers
from .plan import RankPlan
from .rotary import rows_width
from .weights import ProjectionWeights


class LatentLayer(CacheLayerMixin):
    """One layer's latent buffers, per side (K, V): the latents (model dtype, or packed uint8 codes when
    quantized) with their fp16 scale and zero point and the exact sink and window tokens (empty when not
    quantized), and the positions and RoPE rows buffers all layers share; see `lowering/quantize.py` for the
    layout.
    `keys`/`values` alias the latent buffers so transformers' generic reset/reorder code works on them."""

    is_compileable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, k_buffers, v_buffers, positions, rope_rows, layer_idx):
        super().__init__()
        # [max_batch, slots, rank | width], or [max_batch, slots, blocks, width / blocks] (`quantize.by_blocks`)
        self.keys, self.k_scale, self.k_zero, self.k_exact = k_buffers
        self.values, self.v_scale, self.v_zero, self.v_exact = v_buffers
        self.positions = positions  # int32 [max_batch, max_cache_len], shared by all layers
        self.rope_rows = rope_rows  # [max_batch, max_cache_len, 2, rotary_dim] cos and sin (or empty), shared
        # masks cover the whole context (column = sequence index), also where the latents are a shorter ring
        self.max_cache_len = positions.shape[1]
        self.batch_size = self.keys.shape[0]
        self.layer_idx = layer_idx
        self.cumulative_length = torch.zeros((), dtype=torch.long, device=self.keys.device)
        self.is_initialized = True
        _static(self.tensors() + [self.positions, self.rope_rows, self.cumulative_length])

    _TENSORS = ("keys", "k_scale", "k_zero", "k_exact", "values", "v_scale", "v_zero", "v_exact")

    def tensors(self) -> list:
        return [getattr(self, name) for name in self._TENSORS]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder every buffer along the batch (the base class reorders keys and values only,
        which would read codes with another beam's scales)."""
        if self.get_seq_length() > 0:
            for tensor in self.tensors():
                if tensor.numel():  # in place: the layout (rows or by blocks) and the address stay
                    tensor[:beam_idx.numel()].copy_(tensor.index_select(0, beam_idx.to(tensor.device)))

    def reset(self) -> None:
        super().reset()
        for tensor in (self.k_scale, self.k_zero, self.k_exact, self.v_scale, self.v_zero, self.v_exact,
                       self.positions, self.rope_rows):
            tensor.zero_()

    def lazy_initialization(self, key_states, value_states):
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = ops.cache_marker(
            key_states=key_states, value_states=value_states, latent_k=self.keys, k_scale=self.k_scale,
            k_zero=self.k_zero, k_exact=self.k_exact, latent_v=self.values, v_scale=self.v_scale, v_zero=self.v_zero,
            v_exact=self.v_exact, positions=self.positions, rope_rows=self.rope_rows, length=self.cumulative_length,
            layer_idx=self.layer_idx)
        self.cumulative_length.add_(key_states.shape[-2])
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len


def _static(tensors) -> None:
    """Tell Dynamo the cache's buffers keep their addresses (as transformers' StaticLayer does), so CUDA graphs
    (mode="reduce-overhead") replay with them in place instead of copying them in."""
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


def sliding_windows(config, layers: int) -> list:
    """Each layer's sliding window (None for global attention), as transformers' own cache lays the model out."""
    stock = DynamicCache(config=config)
    if len(stock.layers) != layers:
        return [None] * layers
    return [getattr(layer, "sliding_window", None) if layer.is_sliding else None for layer in stock.layers]


def ring_slots(window: int, site) -> int:
    """Slots of a sliding-window layer's latent ring: the window, rounded up to whole blocks of each channel-axis
    side (a block's codes share one slot range); the mask hides the slots past the window."""
    multiple = math.lcm(*(layout.group for layout in (site.k_layout, site.v_layout)
                          if layout.bits != 16 and layout.axis == "channel"), 1)
    return -(-window // multiple) * multiple


def _stock_layer(config, max_batch_size, max_cache_len, dtype, device) -> StaticLayer:
    """A transformers StaticLayer for a layer the plan leaves full, allocated now (not lazily inside a trace)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layer = StaticLayer(max_cache_len=max_cache_len)
    empty = torch.zeros(max_batch_size, kv_heads, 0, head_dim, dtype=dtype, device=device)
    layer.lazy_initialization(empty, empty)
    return layer


class LatentCache(Cache):
    """Preallocated latent KV cache for `model` under `plan`.

    Each layer the plan covers holds latents (`LatentLayer`); a layer it leaves out (a partial plan, or attention
    the matcher cannot rewrite) holds full keys and values in a transformers `StaticLayer`, so a partly matched
    model runs with stock layers beside latent ones. A sliding-window layer's latents are a ring of `ring_slots`
    slots (sequence index i in slot i % slots) when that is shorter than max_cache_len: its bytes do not grow
    with the context.

    nbytes() is what the buffers occupy: per latent layer and side max_batch_size x slots x the side's
    bytes per token (rank values of the model's dtype, or packed codes plus fp16 scales and zero points),
    the exact sink and window tokens of quantized sides, and one int32 position per slot and sequence (plus, for
    a model that recomputes its RoPE frequencies as it runs, `rotary.py`, the cos and sin rows of each token: 2 x
    rotary_dim values of the model's dtype, for all layers together); per stock layer its full keys and values.
    At max_cache_len = plan.context, nbytes() / full_cache_nbytes(torch.float16) is plan.budget when the plan
    covers every layer and the model is 16-bit or every side is quantized (16-bit sides are held in the model's
    dtype).
    """

    def __init__(self, model, plan: RankPlan, max_batch_size: int = 1, max_cache_len: int = 2048,
                 dtype: torch.dtype | None = None, device=None):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} must be an integer >= 1")
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len={max_cache_len!r} must be an integer >= 1")
        check_parameters(plan, model)
        model_layer_count = model_layers(model)
        beyond = [site.layer for site in plan.sites if site.layer >= model_layer_count]
        if beyond:
            raise PlanMismatchError(f"the plan lists layers {beyond}, but the model has {model_layer_count} layers; "
                                    "make the plan on this model, or carry it over with lrkv.transfer")
        reference = ProjectionWeights(model)[plan.sites[0].k_weight]
        dtype = dtype or reference.dtype
        device = device or reference.device
        positions = torch.zeros(max_batch_size, max_cache_len, dtype=torch.int32, device=device)
        try:
            width = rows_width(model)
        except NotImplementedError as why:
            raise UnrewrittenSiteError(f"lrkv: {why}; a LatentCache cannot hold this model's keys") from None
        rope_rows = torch.zeros(max_batch_size, max_cache_len, 2, width, dtype=dtype, device=device) if width \
            else torch.zeros(0, dtype=dtype, device=device)

        def buffers(rank, layout, slots, blocks):
            latents, groups = layout.stored_widths(rank)
            rows = layout.scale_rows(slots)
            quantized = layout.bits != 16
            # a quantized side of a block-diagonal factor stored by blocks where it can be (head-major: each KV
            # head's codes in one run, `quantize.by_blocks`), else as rows
            stored = stored_blocks(layout.bits, layout.group, layout.axis, layout.outliers, rank, blocks)

            def empty():  # one per buffer: the ops mutate them, so no two may alias
                return torch.zeros(0, dtype=torch.float16, device=device)
            return (by_blocks(max_batch_size, slots, latents, stored, torch.uint8 if quantized else dtype, device),
                    by_blocks(max_batch_size, rows, groups, stored, torch.float16, device) if quantized else empty(),
                    by_blocks(max_batch_size, rows, groups, stored, torch.float16, device) if quantized else empty(),
                    torch.zeros(max_batch_size, layout.exact_slots, rank, dtype=exact_dtype(dtype), device=device)
                    if quantized and layout.exact_slots else empty())

        planned = {site.layer: site for site in plan.sites}
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        windows = sliding_windows(config, model_layer_count)
        layers = []
        for index in range(model_layer_count):
            site = planned.get(index)
            if site is None:
                layers.append(_stock_layer(config, max_batch_size, max_cache_len, dtype, device))
                continue
            slots = min(max_cache_len, ring_slots(windows[index], site)) if windows[index] else max_cache_len
            layers.append(LatentLayer(buffers(site.rank_k, site.k_layout, slots, site.k_blocks),
                                      buffers(site.rank_v, site.v_layout, slots, site.v_blocks), positions, rope_rows,
                                      index))
        super().__init__(layers=layers)
        self.plan, self.dtype, self.positions, self.rope_rows = plan, dtype, positions, rope_rows
        self._capacity = (max_batch_size, max_cache_len)
        ratio = self.nbytes() / self.full_cache_nbytes()
        if ratio >= 1:
            warnings.warn(f"lrkv: this LatentCache takes {ratio:.2f}x the bytes of a full cache of the same capacity "
                          f"(plan keep={plan.keep:.2f}): it saves no memory; use a plan with a smaller keep or budget",
                          LrkvWarning, stacklevel=2)

    # transformers 5.x up to 5.17 defines these two on Cache as read-only (deprecated) properties
    @property
    def max_batch_size(self) -> int:
        return self._capacity[0]

    @property
    def max_cache_len(self) -> int:
        return self._capacity[1]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: every layer's buffers, then the positions and RoPE rows all latent layers share (once)."""
        super().reorder_cache(beam_idx)
        if self.get_seq_length() > 0:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))
            if self.rope_rows.numel():
                self.rope_rows = self.rope_rows.index_select(0, beam_idx.to(self.rope_rows.device))
            _static([self.positions, self.rope_rows])
            for layer in self.layers:
                if isinstance(layer, LatentLayer):
                    layer.positions, layer.rope_rows = self.positions, self.rope_rows

    def nbytes(self) -> int:
        """Bytes held by the cache's buffers (its capacity)."""
        tensors = [t for layer in self.layers
                   for t in (layer.tensors() if isinstance(layer, LatentLayer) else (layer.keys, layer.values))]
        return sum(t.numel() * t.element_size() for t in tensors + [self.positions, self.rope_rows])

    def full_cache_nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes a full (uncompressed) K/V cache of the same capacity would hold, in `dtype` (default: the
        cache's dtype)."""
        element = (dtype or self.dtype).itemsize
        planned = {site.layer: site for site in self.plan.sites}
        per_token = sum(2 * planned[index].num_kv_heads * planned[index].head_dim if index in planned
                        else layer.keys.shape[1] * (layer.keys.shape[-1] + layer.values.shape[-1])
                        for index, layer in enumerate(self.layers))
        return self.max_batch_size * self.max_cache_len * per_token * element
