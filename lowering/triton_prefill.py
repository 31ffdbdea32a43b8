"""Triton lowering of `latent_attention` for prefill and chunked prefill (any number of new tokens per sequence):
input checks, the choice of path, launch grids, strides, and the value up-projection after the kernel.

Two paths (`choose_path`): the flash-style kernel `kernels/latent_prefill.py`, whose every tile of queries reads and
dequantizes the slots' latents and rebuilds their keys again; and, for chunks long enough that this costs more than
one pass, the rebuild path: `kernels/latent_rebuild.py` rebuilds each slot's key (turned to its position) and copies
its value latent once into dense buffers of the model's dtype, one layer's worth, and
`F.scaled_dot_product_attention(..., enable_gqa=True)` (flash or memory-efficient, on CUDA) attends over them in
latent space; under windowed RoPE the keys go unturned too, and two flash-attention passes (near slots over the turned
keys, far ones over the unturned) merge by their log-sum-exps (`_windowed_attention`).

`prefill_attention(**kwargs)` takes the keyword arguments `triton_decode.decode_attention` takes (those of
`reference.latent_attention` that `ops.latent_attention` passes to a kernel) and returns what the reference returns,
for tokens >= 1; anything it does not cover raises NotImplementedError naming what, so the caller can run the
reference instead.

Memory: the reference builds float32 scores [batch, heads, tokens, slots] and every slot's keys at once. The kernel
path allocates nothing that grows with tokens x slots: the kernel keeps per program one tile of queries, keys and
scores on chip, and writes the latent context [batch, tokens, heads, range] (range: the value latent channels a KV
head reads); the value up-projection then makes [batch, heads, tokens, head_dim]. Both grow with tokens only. The
length stays on the device and the grid depends on the shapes alone, so a step reads nothing back to the host once
the factors' blocks are known (`triton_decode.prepare`) and the autotuner has chosen a geometry for its shapes. The
rebuild path reads the length on the host, so that its buffers hold exactly the slots written (under CUDA-graph
capture, which cannot read it, they hold the cache's capacity, zeroed, and the mask hides the slots past the length);
it allocates keys and value latents [batch, kv_heads, slots, head_dim | range] in the model's dtype, and, with a
prefix or the model's mask, one boolean mask [tokens, slots] (times the mask's batch and heads, as the model's own):
a byte per pair, where SDPA's flash and memory-efficient kernels keep their scores on chip. Under windowed RoPE it
allocates the keys twice (turned and not) and all three buffers at one width, zero-padded, and checks the model's
mask with a boolean temporary of its shape; its flash-attention passes take no mask.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lrkv_compile.kernels import latent_prefill, latent_rebuild
from . import reference
from .triton_decode import (BITS, DTYPES, _side, check_inputs, diagonal_blocks, project_values, side_arguments,
                            side_widths)

LONGEST_BUCKET = 1024  # the autotuner tunes once per power of two of the new tokens up to this, once for all longer
# chunks of at least this many tokens take the rebuild path (`choose_path`): with quantized latents, and with 16-bit
# latents only from a longer chunk, since the kernel's tiles read them without dequantizing (H200, Llama-3-8B, 16K
# context, batch 1, benchmarks/prefill.py: 64 tokens, budget 0.2: kernel 1.45 ms, rebuild 0.67; keep 0.5: 0.58 and
# 0.83; 256 tokens, keep 0.5: 0.47 and 0.54-0.64; 512: 0.66 and 0.59-0.82, the crossover; 2048: 2.51 and 1.53-1.63)
REBUILD_TOKENS = 64
REBUILD_TOKENS_16BIT = 512
FLASH_WIDTH = 256  # the widest heads PyTorch's flash-attention kernel takes (the windowed rebuild path's passes)
REBUILD_SLOTS_INTERPRETED = 16  # the rebuild kernel's tile of slots under the interpreter: several tiles in small tests


def _mask_strides(attn_mask, batch, heads, tokens):
    """(kind, strides over batch, heads, tokens, slots) of the model's mask [batch|1, 1|heads, tokens|1, columns]:
    kind 1 boolean, 2 additive; a broadcast axis gets stride 0."""
    if attn_mask.dim() != 4 or attn_mask.shape[0] not in (1, batch) or attn_mask.shape[1] not in (1, heads) \
            or attn_mask.shape[2] not in (1, tokens):
        raise NotImplementedError(f"attn_mask of shape {tuple(attn_mask.shape)}: expected [batch|1, 1|heads, "
                                  "tokens|1, slots]")
    strides = [attn_mask.stride(axis) if attn_mask.shape[axis] > 1 else 0 for axis in range(3)]
    return (1 if attn_mask.dtype == torch.bool else 2), (*strides, attn_mask.stride(3))


def prefill_attention(*, query, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, positions,
                      new_k, new_v, up_k, bias_k, up_v, bias_v, inv_freq, rope_scale, length, attn_mask,
                      softmax_scale, num_kv_heads, k_bits, k_group, k_sinks, k_axis, k_outliers, v_bits, v_group,
                      v_sinks, v_axis, v_outliers, rope_window=0):
    """`reference.latent_attention` for `tokens` new tokens per sequence (query [batch, heads, tokens, head_dim]):
    the earlier slots read from the cache, this step's from new_k / new_v, on the path `choose_path` picks."""
    return prefill_attention_with(None, **{name: value for name, value in locals().items()})


def choose_path(query, attn_mask, rope_window, k_bits, v_bits) -> str:
    """"rebuild" for chunks of at least REBUILD_TOKENS tokens (REBUILD_TOKENS_16BIT where both sides' latents are
    16-bit) that it covers as far as their shapes tell (`rebuild_refusal`): one layer's keys and value latents rebuilt
    into dense buffers, then SDPA; else "kernel", the flash-style kernel, which re-reads the latents per tile of
    queries. Under windowed RoPE the step's values may still send a "rebuild" step to the kernel
    (`_flash_windows_refusal`)."""
    least = REBUILD_TOKENS_16BIT if k_bits == v_bits == 16 else REBUILD_TOKENS
    if query.shape[2] < least or rebuild_refusal(query, attn_mask, rope_window) is not None:
        return "kernel"
    return "rebuild"


def _capturing(query) -> bool:
    """Whether this step is being captured into a CUDA graph (mode="reduce-overhead"), which reads nothing on the
    host."""
    return query.is_cuda and torch.cuda.is_current_stream_capturing()


def rebuild_refusal(query, attn_mask, rope_window, v_range=None):
    """Why the rebuild path cannot compute a step (None: it can), as far as the shapes tell. Windowed RoPE takes it
    through two flash-attention passes whose windows are counted in slots (`_windowed_attention`), which need a
    half-precision query, the host to know the length, and value latents of at most FLASH_WIDTH channels (v_range,
    where known); the step's values decide the rest (`_flash_windows_refusal`)."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        return ("an additive mask: CUDA's SDPA zeroes a query whose visible columns the mask's finfo.min covers "
                "entirely, where the reference attends uniformly over them (the prefill kernel does too)")
    if not rope_window:
        return None
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"windowed RoPE in {query.dtype}: its flash-attention passes take float16 and bfloat16"
    if query.is_cuda and not (torch.backends.cuda.is_flash_attention_available()
                              and torch.cuda.get_device_capability(query.device) >= (8, 0)):
        return "windowed RoPE without PyTorch's flash-attention kernel on this device (it needs sm_80 or newer)"
    if _capturing(query):
        return "windowed RoPE under CUDA-graph capture: its windows need the length on the host"
    if v_range is not None and v_range > FLASH_WIDTH:
        return f"windowed RoPE with value latents of {v_range} channels, wider than flash attention's {FLASH_WIDTH}"
    return None


def _flash_windows_refusal(positions, attn_mask, length, batch, tokens):
    """(the length, None or why the windowed rebuild path cannot take the step), read on the host at once. Its
    flash-attention windows are counted in slots and take no mask, so it needs every row's positions to run on by
    one from slot to slot up to the length, and the model's boolean mask, if any, to show every slot causality shows
    (no left padding) and to cover every slot written."""
    length = length.reshape(()).long()
    steps = positions[:batch, 1:].long() - positions[:batch, :-1].long()
    beyond = torch.arange(1, positions.shape[1], device=positions.device) >= length  # slots past the length
    runs = ((steps == 1) | beyond).all()
    shows = torch.ones((), dtype=torch.bool, device=positions.device)
    if attn_mask is not None:
        columns = torch.arange(attn_mask.shape[-1], device=attn_mask.device)
        causal = columns[None, :] <= length - tokens + torch.arange(tokens, device=attn_mask.device)[:, None]
        shows = (attn_mask | ~causal).all()
    written, runs, shows = torch.stack((length, runs.long(), shows.long())).tolist()
    if attn_mask is not None and attn_mask.shape[-1] < written:
        return written, f"windowed RoPE with a mask of {attn_mask.shape[-1]} columns for {written} slots"
    if not shows:
        return written, "windowed RoPE with a mask that hides slots causality shows (left padding)"
    if not runs:
        return written, "windowed RoPE over positions that do not run on by one from slot to slot"
    return written, None


def prefill_attention_with(path, *, query, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact,
                           positions, new_k, new_v, up_k, bias_k, up_v, bias_v, inv_freq, rope_scale, length,
                           attn_mask, softmax_scale, num_kv_heads, k_bits, k_group, k_sinks, k_axis, k_outliers,
                           v_bits, v_group, v_sinks, v_axis, v_outliers, rope_window=0):
    """`prefill_attention` on `path` ("kernel", "rebuild", or None: `choose_path`'s)."""
    batch, heads, tokens, head_dim = query.shape
    device = query.device
    interpret = check_inputs(query, num_kv_heads, inv_freq, "prefill")
    if latent_k.shape[1] < positions.shape[1]:
        raise NotImplementedError("the Triton prefill kernel reads a full-length cache, not a sliding-window ring")
    for name, bits, axis in (("k", k_bits, k_axis), ("v", v_bits, v_axis)):
        if bits not in BITS:
            raise NotImplementedError(f"{name}_bits={bits}: the Triton prefill kernel reads bits {BITS}")
        if axis not in ("token", "channel"):
            raise NotImplementedError(f"{name}_axis={axis!r}: the Triton prefill kernel reads 'token' and 'channel' "
                                      "scales")
    group = heads // num_kv_heads
    k_blocks = diagonal_blocks(up_k, num_kv_heads)
    v_blocks = diagonal_blocks(up_v, num_kv_heads) if up_v is not None else 1
    # _side reads a side's rank from its new latents and checks the cache's layout; this step's latents go to the
    # kernel whole below. Codes are dequantized in the model's dtype (no PACKED float16 path).
    keys = _side("k", latent_k, k_scale, k_zero, k_exact, new_k[:, :1], k_bits, k_group, k_sinks, k_axis, k_outliers,
                 k_blocks, False)
    values = _side("v", latent_v, v_scale, v_zero, v_exact, new_v[:, :1], v_bits, v_group, v_sinks, v_axis,
                   v_outliers, v_blocks, False)
    v_range = values["BLOCK_RANK"]

    if not isinstance(length, torch.Tensor):
        length = torch.tensor(int(length), device=device)
    length = length.to(device)
    query, new_k, new_v = (tensor if tensor.stride(-1) == 1 else tensor.contiguous()
                           for tensor in (query, new_k, new_v))  # the kernel takes the other strides
    up = up_k.to(query.dtype).contiguous()
    mask_kind, mask, mask_strides, mask_width = 0, query, (0, 0, 0, 0), 0
    if attn_mask is not None:
        mask_kind, mask_strides = _mask_strides(attn_mask, batch, heads, tokens)
        mask, mask_width = attn_mask, attn_mask.shape[3]
    rope = inv_freq is not None
    window = int(rope_window) if rope else 0  # windowed RoPE's window (0: exact RoPE)
    k, v = keys, values
    cache_args = (*side_arguments(k), new_k, new_k.stride(0), new_k.stride(1),
                  *side_arguments(v), new_v, new_v.stride(0), new_v.stride(1),
                  positions, positions.stride(0), up, up.stride(0),
                  bias_k.float().contiguous() if bias_k is not None else query,
                  inv_freq.float().contiguous() if rope else query)
    side_constants = dict(
        KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        K_HEADS_PER_BLOCK=num_kv_heads // k_blocks, K_BLOCK_RANK=k["BLOCK_RANK"], K_CHUNK=k["CHUNK"],
        K_BITS=k_bits, K_GROUP=k["GROUP"], K_FAST=k["FAST"], K_EXACT=k["EXACT"], K_CHANNEL=k["CHANNEL"],
        K_OUTLIERS=k["OUTLIERS"], K_STORED=k["STORED"],
        V_HEADS_PER_BLOCK=num_kv_heads // v_blocks, V_BLOCK_RANK=v_range, V_CHUNK=v["CHUNK"],
        V_BITS=v_bits, V_GROUP=v["GROUP"], V_FAST=v["FAST"], V_EXACT=v["EXACT"], V_CHANNEL=v["CHANNEL"],
        V_OUTLIERS=v["OUTLIERS"], V_STORED=v["STORED"],
        HAS_ROPE=rope, HAS_BIAS=bias_k is not None, FAST_MATH=not interpret, DTYPE=DTYPES[query.dtype],
        DOT_DTYPE=tl.float32 if interpret else DTYPES[query.dtype],  # the interpreter's dot misreads bf16
        IEEE=query.dtype == torch.float32)
    widths = (*side_widths(k), *side_widths(v))  # the kernels' cache sides
    scale = softmax_scale * (rope_scale if rope else 1.0)  # RoPE's scale multiplies every key
    forced = path is not None
    if path is None:
        path = choose_path(query, attn_mask, window, k_bits, v_bits)
    if path == "rebuild":
        refusal = rebuild_refusal(query, attn_mask, window, v_range)
        written = None
        if refusal is None and window:
            written, refusal = _flash_windows_refusal(positions, attn_mask, length, batch, tokens)
        elif refusal is None and not _capturing(query):
            written = int(length)
        if refusal is not None and forced:
            raise NotImplementedError(f"the prefill rebuild path does not take {refusal}")
        path = "kernel" if refusal is not None else path  # the launcher's own choice falls back to the kernel
    if path == "rebuild":
        context = _rebuilt_attention(query, cache_args, widths, side_constants, length, written, positions, attn_mask,
                                     scale, num_kv_heads, v_range, interpret, inv_freq, window)
        if up_v is None:
            return context.transpose(1, 2).reshape(batch, tokens, heads * v_range)
        # in the model's dtype, one batched product over each KV head's rows (cuDNN's SDPA returns the context in
        # [batch, tokens, heads] order: reshape copies it then)
        return project_values(context.reshape(batch, num_kv_heads, group * tokens, v_range), up_v, bias_v, v_blocks,
                              tokens, query.dtype)
    # [batch, tokens, heads, range]: the absorbed path's output as it is (range is all of rank_v there), else the
    # float32 latent context the up-projection reads
    out = torch.empty(batch, tokens, heads, v_range, dtype=torch.float32 if up_v is not None else query.dtype,
                      device=device)
    grid = lambda meta: (triton.cdiv(tokens, meta["BLOCK_M"] // group), batch * num_kv_heads,  # noqa: E731
                         triton.cdiv(v_range, v["CHUNK"]))
    latent_prefill.latent_prefill_kernel[grid](
        query, query.stride(0), query.stride(1), query.stride(2), *cache_args,
        mask, *mask_strides, mask_width, length,
        out, out.stride(0), out.stride(1), out.stride(2),
        scale, tokens, min(1 << (tokens - 1).bit_length(), LONGEST_BUCKET),
        *widths, window,
        GROUP_HEADS=group, MASK_KIND=mask_kind, WINDOWED=bool(window), **side_constants)
    if up_v is None:
        return out.view(batch, tokens, heads * v_range)
    context = out.view(batch, tokens, num_kv_heads, group, v_range).permute(0, 2, 3, 1, 4)
    return project_values(context.reshape(batch, num_kv_heads, group * tokens, v_range), up_v, bias_v, v_blocks, tokens,
                          query.dtype)


def _rebuilt_attention(query, cache_args, widths, constants, length, written, positions, attn_mask, scale,
                       num_kv_heads, v_range, interpret, inv_freq, window):
    """The rebuild path: every slot's key (turned to its position) and value latent into dense buffers of the model's
    dtype, [batch, kv_heads, slots, head_dim | v_range] (one layer's working set), then
    `F.scaled_dot_product_attention` with enable_gqa over them; with windowed RoPE (window > 0) the keys unturned
    too, the three buffers at one width (zero-padded), and `_windowed_attention` over them. `slots` is the length
    (`written`, read on the host); under CUDA-graph capture, which cannot read it (written None), the cache's
    capacity, the buffers zeroed and the slots past the length masked. Returns the latent context [batch, heads,
    tokens, v_range], 0 for a query that sees no slot."""
    batch, _, tokens, head_dim = query.shape
    slots = positions.shape[1] if written is None else written
    allocate = query.new_zeros if written is None else query.new_empty  # zeros: 0 weight times garbage could be NaN
    if window:  # flash attention takes keys and values of one width, a multiple of 8: the narrower zero-padded to it
        width = max(head_dim, -(-v_range // 8) * 8)
        padded = [(query.new_zeros if width > narrow else query.new_empty)(batch, num_kv_heads, slots, width)
                  for narrow in (head_dim, head_dim, v_range)]
        keys, plain, values = (buffer[..., :narrow] for buffer, narrow in zip(padded, (head_dim, head_dim, v_range)))
    else:
        keys = plain = allocate(batch, num_kv_heads, slots, head_dim)
        values = allocate(batch, num_kv_heads, slots, v_range)
    block_s = REBUILD_SLOTS_INTERPRETED if interpret else (64 if head_dim <= 128 else 32)
    for new, count in ((False, slots - tokens), (True, tokens)):  # the cache's slots, then this step's exact latents
        if count:
            latent_rebuild.rebuild_kernel[(triton.cdiv(count, block_s), batch * num_kv_heads)](
                *cache_args, keys, *keys.stride()[:3], plain, values, *values.stride()[:3], length, tokens,
                *widths, NEW=new, PLAIN=bool(window), BLOCK_S=block_s, num_warps=4, **constants)
    if window:
        return _windowed_attention(query, *padded, positions, inv_freq, window, written, scale)[..., :v_range]
    mask, causal = _visible(attn_mask, tokens, slots, written, length)
    context = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=True)
    if mask is not None:  # a query the mask hides every slot from attends to nothing, as in the reference (CUDA's
        context.masked_fill_(~mask.any(-1, keepdim=True), 0.0)  # SDPA may return finite values there, not NaN)
    return context


def _windowed_attention(query, keys, plain, values, positions, inv_freq, window, written, scale):
    """Attention under windowed RoPE over rebuilt keys, for positions that run on by one from slot to slot (a window
    of positions is then one of slots): a slot fewer than `window` slots behind the query scores against its turned
    key (`keys`), a farther one against its unturned key (`plain`) with the query turned to the window's edge,
    R(window - p) q_rot (`reference.windowed_scores`). Two flash-attention passes, both aligned at the last slot as
    flash attention aligns a chunk after a prefix: the near one over every slot, each query seeing the `window`
    slots up to its own (a sliding window), the far one causal over the slots but the last `window`, for the queries
    that have any; merged by their log-sum-exps into one softmax. Every query sees its own slot, so the merged
    softmax is never empty. keys, plain, values: [batch, kv_heads, slots, width], zero-padded to one width (flash
    attention's need), which the queries are padded to too. Returns the latent context [batch, heads, tokens, width]."""
    batch, heads, tokens, head_dim = query.shape
    earlier = written - tokens
    pad = keys.shape[-1] - head_dim

    def padded(rows):  # queries zero-padded as the keys are
        return F.pad(rows, (0, pad)) if pad else rows

    context, near_lse = _flash_with_lse(padded(query), keys, values, scale, window_left=window - 1)
    first = max(0, window - earlier)  # the first query with a slot `window` or more behind it
    if first >= tokens:
        return context
    # the far queries turned by R(window - p): angles in float64 (positions in the tens of thousands stay exact), the
    # turn in float32, then the query's dtype
    angles = (window - positions[:batch, earlier + first:written].long()).double()[:, None, :, None] * inv_freq.double()
    cos, sin = (torch.cat((f, f), dim=-1).float() for f in (angles.cos(), angles.sin()))
    far_query = padded(reference.turn(query.float()[:, :, first:], cos, sin).to(query.dtype))
    far, far_lse = _flash_with_lse(far_query, plain[:, :, :written - window], values[:, :, :written - window], scale,
                                   window_left=None)
    # the merged softmax: each pass's context weighted by its share of the total exp-sum
    near_share = torch.sigmoid(near_lse[:, :, first:] - far_lse)[..., None].to(context.dtype)
    context[:, :, first:] = torch.lerp(far, context[:, :, first:], near_share)
    return context


def _flash_with_lse(query, keys, values, scale, window_left):
    """Causal attention of query [batch, heads, rows, head_dim] over keys / values [batch, kv_heads, slots,
    head_dim] (GQA), aligned at the last slot (row i sees slots up to i + slots - rows), and only the window_left + 1
    slots up to that where window_left is given: (context [batch, heads, rows, head_dim] in the query's dtype,
    float32 log-sum-exp of each row's scaled scores [batch, heads, rows]). Every row must see a slot (slots >= rows).
    On CUDA, PyTorch's flash-attention kernel, which returns the log-sum-exp; elsewhere (tests under Triton's
    interpreter) the same in float32."""
    batch, heads, rows, _ = query.shape
    slots = keys.shape[2]
    if query.is_cuda:
        context, lse, *_ = torch.ops.aten._flash_attention_forward(
            query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), None, None, rows, slots, 0.0,
            window_left is None, False, scale=scale, window_size_left=window_left,
            window_size_right=None if window_left is None else 0)
        return context.transpose(1, 2), lse[..., :rows]
    column = torch.arange(slots)[None, :]
    last = torch.arange(rows)[:, None] + slots - rows  # the last slot each row sees
    seen = (column <= last) & ((column > last - window_left - 1) if window_left is not None else True)
    group = heads // keys.shape[1]
    scores = (query.float() @ keys.float().repeat_interleave(group, 1).transpose(-1, -2) * scale)
    scores = scores.masked_fill(~seen, float("-inf"))
    context = torch.softmax(scores, dim=-1) @ values.float().repeat_interleave(group, 1)
    return context.to(query.dtype), scores.logsumexp(dim=-1)


def _visible(attn_mask, tokens, slots, written, length):
    """(boolean mask over `slots` columns, is_causal) for SDPA: each query (the last `tokens` of the `length` sequence
    indices written, a device tensor) sees the slots up to its own, and of those what the model's boolean mask
    allows (its columns are sequence indices). written: the length where the host knows it (slots then equals it),
    else None; a prompt without a mask then needs is_causal alone."""
    if attn_mask is None and written == tokens:
        return None, True
    query_index = length - tokens + torch.arange(tokens, device=length.device)
    causal = torch.arange(slots, device=length.device)[None, :] <= query_index[:, None]
    if attn_mask is None:
        return causal, False
    if attn_mask.shape[-1] < slots:
        raise NotImplementedError(f"attn_mask of {attn_mask.shape[-1]} columns for {slots} slots")
    return attn_mask[..., :slots] & causal, False
