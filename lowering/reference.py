"""Plain PyTorch reference implementations of the latent ops: readable, and the oracle of every test.

Shapes use named axes: batch, heads (query heads), kv_heads, tokens (new tokens this step),
slots (cache positions), rank (latent channels), head_dim.
"""
import torch

from lrkv_compile.errors import CacheOverflowError
from . import quantize


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x's first cos.shape[-1] channels by cos and sin (broadcast against them); the channels
    after them (partial rotary) pass as they are."""
    rotary = cos.shape[-1]
    turned = x[..., :rotary]
    out = turned * cos
    out += rotate_half(turned) * sin  # in place: one temporary fewer, the same sums
    return out if rotary == x.shape[-1] else torch.cat((out, x[..., rotary:]), dim=-1)


def _store(latent, scale, zero, exact, new, bits, group, sinks, axis, outliers, batch, indices):
    """Write new [batch, tokens, rank] latents of sequence indices `indices` ([tokens], consecutive, a tensor):
    quantized if bits < 16, and exact copies of the sinks (index < sinks) and of the last `window` indices (ring
    entry sinks + index % window). Index i goes to slot i % slots (slots = latent.shape[1]): the identity for a
    cache as long as the context, a ring for a sliding-window layer, which keeps the last `slots` indices (a
    multiple of a channel-axis group). Per channel (axis "channel"), the blocks of `group` indices this write
    completes are quantized from their 16-bit copies: the earlier indices' from the window ring, which holds them
    (window >= group), this step's rounded.
    16-bit and per-token sides, and a per-channel side's one-token (decode) write, use tensor indices only, so the
    write never waits for the device (CUDA graphs can capture it); a per-channel write of several tokens reads
    where its blocks start on the host."""
    capacity = latent.shape[1]
    kept = indices[-capacity:]  # a ring keeps the last `capacity` indices
    slots = kept % capacity
    if bits == 16:
        latent[:batch].index_copy_(1, slots, new[:, -capacity:].to(latent.dtype))
        return
    window = exact.shape[1] - sinks if exact.numel() else 0
    if axis == "token":
        codes, new_scale, new_zero = quantize.quantize(new[:, -capacity:], bits, group, axis, outliers)
        latent[:batch].index_copy_(1, slots, quantize.like_stored(codes, latent))
        scale[:batch].index_copy_(1, slots, quantize.like_stored(new_scale.to(scale.dtype), scale))
        zero[:batch].index_copy_(1, slots, quantize.like_stored(new_zero.to(zero.dtype), zero))
    elif len(indices) == 1:  # decode: the token's block, quantized every step, kept where the token completes it
        start = indices[0]
        block = start - start % group + torch.arange(group, device=new.device)
        # the block's earlier indices from the window ring (window >= group); later ones are stale until it fills
        span = torch.where((block == start)[None, :, None], new[:, :1].to(exact.dtype),
                           exact[:batch, sinks + block % window])
        codes, new_scale, new_zero = quantize.quantize(span, bits, group, axis, outliers)
        complete = start % group == group - 1
        slots, row = block % capacity, ((start // group) % scale.shape[1]).reshape(1)  # a tensor index, not an int
        latent[:batch, slots] = torch.where(complete, codes, latent[:batch, slots])
        scale[:batch, row] = torch.where(complete, new_scale, scale[:batch, row])
        zero[:batch, row] = torch.where(complete, new_zero, zero[:batch, row])
    else:
        start, tokens = int(indices[0]), len(indices)
        first, end = start - start % group, (start + tokens) // group * group
        first = max(first, end - capacity)  # a ring keeps whole blocks: the last capacity / group of them
        if end > first:
            # the blocks' indices before this write, from the window ring: none where the ring keeps only this
            # write's (a prompt longer than a sliding-window layer's ring starts its kept blocks past `start`)
            earlier = exact[:batch, sinks + torch.arange(first, max(first, start), device=new.device) % window]
            span = torch.cat((earlier, new[:, max(0, first - start):end - start].to(exact.dtype)), dim=1)
            codes, new_scale, new_zero = quantize.quantize(span, bits, group, axis, outliers)
            latent[:batch, torch.arange(first, end, device=new.device) % capacity] = codes
            rows = torch.arange(first // group, end // group, device=new.device) % scale.shape[1]
            scale[:batch, rows] = new_scale
            zero[:batch, rows] = new_zero
    if exact.numel():
        if sinks:  # sink j takes this step's token j - indices[0] where there is one, else keeps what it holds
            offset = torch.arange(sinks, device=new.device) - indices[0]
            written = (offset >= 0) & (offset < len(indices))
            incoming = new[:, offset.clamp(0, len(indices) - 1)].to(exact.dtype)
            exact[:batch, :sinks] = torch.where(written[None, :, None], incoming, exact[:batch, :sinks])
        if window:
            recent = indices[-window:]
            exact[:batch].index_copy_(1, sinks + recent % window, new[:, -len(recent):].to(exact.dtype))


ROOM_FIX = "create the LatentCache with max_cache_len >= prompt length + max_new_tokens"


def _check_room(length, tokens, capacity, batch, max_batch) -> bool:
    """A CacheOverflowError where the batch passes the cache's `max_batch` rows or the context would pass its
    `capacity` slots; whether the context was checked here. On the GPU it is not: the check runs there, so the write
    never waits for the device, and the caller asserts it on the device (`_assert_room`; the Triton write's kernel
    compares it itself)."""
    if batch > max_batch:
        raise CacheOverflowError(f"batch of {batch} sequences but this LatentCache holds max_batch_size={max_batch}; "
                                 "create it with a larger max_batch_size")
    if length.device.type != "cpu":
        return False
    if int(length) + tokens > capacity:
        raise CacheOverflowError(f"the context needs {int(length) + tokens} cache slots but this LatentCache "
                                 f"holds max_cache_len={capacity}; {ROOM_FIX}")
    return True


def _assert_room(fits: torch.Tensor, capacity: int) -> None:
    """The context check on the device: an assertion the device raises where `fits` (one element) is zero."""
    torch._assert_async(fits, f"lrkv CacheOverflowError: the context needs more cache slots than this LatentCache "
                              f"holds (max_cache_len={capacity}); {ROOM_FIX}")


def ring_indices(start: int, ring: int, device) -> torch.Tensor:
    """The sequence index each slot of a ring of `ring` slots holds after indices [0, start) were written (-1:
    none): slot j holds the latest index i < start with i % ring == j."""
    slot = torch.arange(ring, device=device)
    behind = start - 1 - slot
    return torch.where(behind >= 0, slot + behind.div(ring, rounding_mode="floor") * ring, -1)


def read_ring(latent, scale, zero, exact, bits, group, sinks, axis, outliers, new, start):
    """A sliding-window layer's ring, read before this step's write of `new` [batch, tokens, rank] at indices
    [start, start + tokens), as reads after that write see it: float32 [batch, ring, rank] and the index each slot
    holds (`ring_indices`). A slot reads exact where the cache holds it exact after the write (sinks, and the
    window's newest indices counted after this step), and a channel-axis block this step completes reads as the
    write will quantize it."""
    batch, tokens = new.shape[0], new.shape[1]
    ring = latent.shape[1]
    indices = ring_indices(start, ring, new.device)
    if bits == 16:
        return latent[:batch].float(), indices
    values = quantize.dequantize(quantize.rows_of(latent[:batch]), quantize.rows_of(scale[:batch]),
                                 quantize.rows_of(zero[:batch]), bits, group, axis, outliers)
    window = exact.shape[1] - sinks if exact.numel() else 0
    if axis == "channel":
        first, end = start - start % group, (start + tokens) // group * group
        if end > first < start:  # earlier indices of the open block, which this step completes
            earlier = torch.arange(first, start, device=new.device)
            span = torch.cat((exact[:batch, sinks + earlier % window], new[:, :end - start].to(exact.dtype)), dim=1)
            values[:, earlier % ring] = quantize.fake_quantize(span, bits, group, axis, outliers)[:, :start - first].float()
    if exact.numel():
        sink = (indices >= 0) & (indices < sinks)
        values[:, sink] = exact[:batch, indices[sink]].float()
        if window:
            recent = indices >= max(0, start + tokens - window)
            values[:, recent] = exact[:batch, sinks + indices[recent] % window].float()
    return values, indices


def read_latents(latent, scale, zero, exact, bits, group, sinks, axis, outliers, batch, slots,
                 written) -> torch.Tensor:
    """The first `slots` latents of the first `batch` rows as float32 [batch, slots, rank], dequantized, with the
    exact copies where the cache holds them: sinks, and the window's ring as it stands after `written` slots
    (which also holds a channel-axis block not yet full, whose codes are not written yet)."""
    if bits == 16:
        return latent[:batch, :slots].float()
    rows = -(-slots // group) if axis == "channel" else slots
    values = quantize.dequantize(quantize.rows_of(latent[:batch, :slots]), quantize.rows_of(scale[:batch, :rows]),
                                 quantize.rows_of(zero[:batch, :rows]), bits, group, axis, outliers)
    if exact.numel():
        window = exact.shape[1] - sinks
        count = min(sinks, slots)
        values[:, :count] = exact[:batch, :count].float()
        if window:
            recent = torch.arange(min(max(0, written - window), slots), slots, device=values.device)
            values[:, recent] = exact[:batch, sinks + recent % window].float()
    return values


def latent_write(latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, positions, new_k, new_v,
                 new_positions, length, k_bits, k_group, k_sinks, k_axis, k_outliers, v_bits, v_group, v_sinks, v_axis,
                 v_outliers, rope_rows=None, new_cos=None, new_sin=None, device_check=True) -> None:
    """Write this step's latents (quantized per side's layout, with exact sink and window copies) and their
    positions at sequence indices [length, length + tokens) (slots index % slots: a ring where the latents are
    shorter than the context, `_store`).

    latent_k: [max_batch, slots, rank_k] (or packed codes); new_k: [batch, tokens, rank_k]; new_positions:
    [batch|1, tokens] integer positions (None for a model without RoPE, or one whose RoPE is stored as rows);
    length: scalar tensor, slots already written before this step. new_cos, new_sin: this step's RoPE rows
    [batch|1, 1, tokens, rotary_dim] (as the model multiplies keys by them), stored in rope_rows [max_batch, slots,
    2, rotary_dim] where the model recomputes its RoPE frequencies as it runs (None: it does not). device_check:
    whether a context past the cache is asserted on the device, where the host does not check it (`ops.latent_write`).
    """
    batch, tokens = new_k.shape[0], new_k.shape[1]
    capacity = positions.shape[1]  # a sliding-window layer's latents are a shorter ring; positions cover the context
    length = torch.as_tensor(length, device=positions.device)
    if not _check_room(length, tokens, capacity, batch, latent_k.shape[0]) and device_check:
        # against capacity - tokens, a number: one comparison kernel before the assertion's own, not an addition too
        _assert_room(length <= capacity - tokens, capacity)
    indices = length + torch.arange(tokens, device=positions.device)  # sequence indices [tokens]
    _store(latent_k, k_scale, k_zero, k_exact, new_k, k_bits, k_group, k_sinks, k_axis, k_outliers, batch, indices)
    _store(latent_v, v_scale, v_zero, v_exact, new_v, v_bits, v_group, v_sinks, v_axis, v_outliers, batch, indices)
    if new_positions is not None:
        positions[:batch].index_copy_(1, indices, torch.broadcast_to(new_positions, (batch, tokens)).to(positions.dtype))
    if new_cos is not None:
        rope_rows[:batch].index_copy_(1, indices, step_rows(new_cos, new_sin, batch, tokens).to(rope_rows.dtype))


def step_rows(new_cos, new_sin, batch, tokens) -> torch.Tensor:
    """cos and sin [batch|1, 1, tokens, rotary_dim] of this step's tokens as rows [batch, tokens, 2, rotary_dim]."""
    rows = torch.stack((new_cos.reshape(new_cos.shape[0], tokens, -1), new_sin.reshape(new_sin.shape[0], tokens, -1)),
                       dim=2)
    return torch.broadcast_to(rows, (batch, *rows.shape[1:]))


def rope_tables(positions, inv_freq, rope_scale, dtype, rope_cos=None, rope_sin=None):
    """cos and sin [..., rotary_dim] of integer `positions` [...] for rotate-half RoPE, as transformers' rotary
    embeddings compute them: in float32, of the angles position * inv_freq, or read from the model's own tables
    rope_cos / rope_sin [max_positions, rotary_dim / 2] where given (GPT-J); repeated over both halves, times the
    attention scaling, then cast."""
    if rope_cos is None:
        angles = positions.float()[..., None] * inv_freq.float()
        cos, sin = angles.cos(), angles.sin()
    else:
        cos, sin = rope_cos[positions.long()].float(), rope_sin[positions.long()].float()
    cos, sin = (cos * rope_scale).to(dtype), (sin * rope_scale).to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def rms_norm(x, weight, offset, eps):
    """x / rms(x) * (offset + weight) over the last axis, in float32, cast back (transformers' per-head q/k norms)."""
    x32 = x.float()
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normalized * (offset + weight.float())).to(x.dtype)


def reconstruct_keys(latent_k, positions, inv_freq, rope_scale, up_k, bias_k, num_kv_heads, norm=None, rope_cos=None,
                     rope_sin=None, rows=None):
    """Keys of the first slots, rebuilt from their (dequantized) latents: RoPE(norm(c_k B_k + b_k)) at each
    slot's own position, norm the per-head RMSNorm (weight, offset, eps) of q/k-norm models or None. Rotate-half
    RoPE (`rope_tables`: from inv_freq, or the tables rope_cos / rope_sin; or each slot's own cos/sin `rows`
    [batch, slots, 2, rotary_dim]) turns the first rotary_dim channels of each head (all of them, or partial
    rotary); no RoPE where inv_freq, rope_cos and rows are None.

    latent_k: [batch, slots, rank_k], positions: [batch, slots] -> [batch, kv_heads, slots, head_dim]
    """
    batch, slots, _ = latent_k.shape
    keys = latent_k @ up_k.to(latent_k.dtype)
    if bias_k is not None:
        keys = keys + bias_k.to(keys.dtype)
    keys = keys.view(batch, slots, num_kv_heads, -1)
    if norm is not None:
        keys = rms_norm(keys, *norm)
    keys = keys.transpose(1, 2)
    if rows is not None:
        cos, sin = rows[:, None, :, 0].to(keys.dtype), rows[:, None, :, 1].to(keys.dtype)
    elif inv_freq is not None or rope_cos is not None:
        cos, sin = rope_tables(positions[:, None], inv_freq, rope_scale, keys.dtype, rope_cos, rope_sin)
    else:
        return keys
    return turn(keys, cos, sin)


def _allowed(attn_mask, tokens, columns):
    """Boolean [batch, 1|heads, tokens, columns]: causal over the sequence index each key column holds (`columns`,
    -1 for an empty ring slot; the queries are the last `tokens` indices), intersected with the model's mask,
    whose columns are sequence indices."""
    slots = int(columns.max()) + 1
    query_index = torch.arange(slots - tokens, slots, device=columns.device)
    allowed = ((columns[None, :] >= 0) & (columns[None, :] <= query_index[:, None]))[None, None]
    additive = None
    if attn_mask is not None:
        mask = attn_mask[..., columns.clamp_min(0)]
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            additive = mask
    return allowed, additive


def _earlier_and_this_step(latent, scale, zero, exact, bits, group, sinks, axis, outliers, new,
                           slots) -> torch.Tensor:
    """float32 [batch, slots, rank]: the earlier steps' latents read back from the cache (dequantized, or exact
    where it holds them), then this step's exact latents `new` [batch, tokens, rank] (the cache's last `tokens`
    slots hold them too)."""
    batch, tokens = new.shape[0], new.shape[1]
    earlier = read_latents(latent, scale, zero, exact, bits, group, sinks, axis, outliers, batch, slots - tokens,
                           slots)
    return torch.cat((earlier, new.float()), dim=1)


def latent_attention(query, latent_k, k_scale, k_zero, k_exact, latent_v, v_scale, v_zero, v_exact, positions, new_k,
                     new_v, up_k, bias_k, up_v, bias_v, inv_freq, rope_scale, length, attn_mask, softmax_scale,
                     num_kv_heads, k_bits, k_group, k_sinks, k_axis, k_outliers, v_bits, v_group, v_sinks, v_axis,
                     v_outliers, k_norm_weight=None, k_norm_offset=0.0, k_norm_eps=0.0, softcap=0.0,
                     new_positions=None, rope_cos=None, rope_sin=None, rope_rows=None, new_cos=None, new_sin=None,
                     rope_window=0):
    """Attention over the latent cache, with keys rebuilt from latents and values kept latent
    until after the reduction over slots (Palu eq. 5: sum_j p_j (c_j B_v) = (sum_j p_j c_j) B_v).

    query: [batch, heads, tokens, head_dim] (RoPE already applied); length: slots valid after this step.
    new_k, new_v: this step's latents [batch, tokens, rank], just written to the cache's last `tokens` slots;
    except in a sliding-window layer, whose latents are a ring shorter than the context (`_store`): its step
    attends before its write, which may overwrite slots the step's first queries still see, and reads the ring as
    the write will leave it (`read_ring`), and takes this step's positions from `new_positions` ([batch|1, tokens]),
    which the cache does not hold yet.
    Tokens of earlier steps are read back from the cache (dequantized, except the sinks and the recent window,
    which it also holds exact); this step's tokens attend to each other with their exact latents, as
    transformers' QuantizedCache and KIVI do with their unquantized residual: quantization costs only what is
    stored. Keys get the model's per-head key norm (k_norm_weight, k_norm_offset, k_norm_eps: `rms_norm`; no
    norm where k_norm_weight is None), then rotate-half RoPE at their stored positions (inv_freq [rotary_dim / 2] and
    rope_scale as the model's rotary embedding, or cos/sin read from the model's tables rope_cos / rope_sin
    [max_positions, rotary_dim / 2], or each slot's own cos/sin rows `rope_rows` [max_batch, slots, 2, rotary_dim]
    where the model recomputes its frequencies as it runs, a ring's step taking its own from new_cos / new_sin
    (`latent_write`); all None: no RoPE; the rewrite puts the channels of interleaved-RoPE models in rotate-half
    order). softcap > 0 caps the scaled scores to softcap * tanh(scores / softcap) before the mask, as
    Gemma 2 does. rope_window > 0 (RoPE from inv_freq only): windowed RoPE (A2ATS, after ReRoPE): a slot whose
    position is rope_window or more behind the query's scores as if exactly rope_window behind it
    (`windowed_scores`), so the kernels score far slots against their latents without rebuilding keys.
    Returns [batch, heads, tokens, head_dim] when up_v is given; otherwise the latent context
    [batch, tokens, heads * rank_v] for an output projection that absorbed B_v.
    """
    batch, heads, tokens, head_dim = query.shape
    slots = int(length)
    if latent_k.shape[1] < positions.shape[1]:  # a sliding-window layer's ring, read before this step's write
        earlier_k, held = read_ring(latent_k, k_scale, k_zero, k_exact, k_bits, k_group, k_sinks, k_axis, k_outliers,
                                    new_k, slots - tokens)
        earlier_v, _ = read_ring(latent_v, v_scale, v_zero, v_exact, v_bits, v_group, v_sinks, v_axis, v_outliers,
                                 new_v, slots - tokens)
        latents_k, latent_values = torch.cat((earlier_k, new_k.float()), 1), torch.cat((earlier_v, new_v.float()), 1)
        columns = torch.cat((held, torch.arange(slots - tokens, slots, device=query.device)))
    else:
        latents_k = _earlier_and_this_step(latent_k, k_scale, k_zero, k_exact, k_bits, k_group, k_sinks, k_axis,
                                           k_outliers, new_k, slots)
        # [batch, slots, rank_v]
        latent_values = _earlier_and_this_step(latent_v, v_scale, v_zero, v_exact, v_bits, v_group, v_sinks, v_axis,
                                               v_outliers, new_v, slots)
        columns = torch.arange(slots, device=query.device)
    keys, scores = None, None
    rope = inv_freq is not None or rope_cos is not None or rope_rows is not None
    if not rope and k_norm_weight is None:  # nothing between the projection and q k^T: keys stay latent
        scores = latent_scores(query, latents_k.to(query.dtype), up_k, bias_k, num_kv_heads)
    else:
        norm = None if k_norm_weight is None else (k_norm_weight, k_norm_offset, k_norm_eps)
        key_positions = positions[:batch, columns.clamp_min(0)]
        if new_positions is not None:  # a ring's step, before its write: the cache holds the earlier positions only
            key_positions[:, -tokens:] = new_positions.to(key_positions.dtype)
        rows = None
        if rope_rows is not None:
            rows = rope_rows[:batch, columns.clamp_min(0)]
            if new_cos is not None:  # a ring's step, before its write, as with new_positions
                rows[:, -tokens:] = step_rows(new_cos, new_sin, batch, tokens).to(rows.dtype)
        if rope_window:  # the keys as projected, and turned to their positions: windowed_scores takes both
            if inv_freq is None or rope_cos is not None or rope_rows is not None:
                raise ValueError("rope_window needs RoPE computed from inv_freq (not cos/sin tables or stored rows)")
            plain = reconstruct_keys(latents_k.to(query.dtype), None, None, 1.0, up_k, bias_k, num_kv_heads, norm)
            keys = turn(plain, *rope_tables(key_positions[:, None], inv_freq, rope_scale, plain.dtype))
            query_positions = new_positions if new_positions is not None else positions[:batch, slots - tokens:slots]
            scores = windowed_scores(query, keys, plain, query_positions, key_positions, inv_freq, rope_scale,
                                     rope_window)
        else:
            keys = reconstruct_keys(latents_k.to(query.dtype), key_positions, inv_freq, rope_scale, up_k, bias_k,
                                    num_kv_heads, norm, rope_cos, rope_sin, rows)
    # rounded to the model's dtype as the eager reference's fake-quantized latents are
    latent_values = latent_values.to(query.dtype).float()
    rank_v, slots = latent_values.shape[-1], latent_values.shape[1]
    allowed, additive = _allowed(attn_mask, tokens, columns)
    mask = allowed if additive is None else additive.float().masked_fill(~allowed, float("-inf"))
    group = heads // num_kv_heads
    up = None if up_v is None else up_v.float().view(rank_v, num_kv_heads, head_dim)
    if up is not None and tokens * group * (rank_v - head_dim) > rank_v * head_dim:
        # many queries per slot (prefill): rebuilding the values first is cheaper than reducing rank_v channels
        # per query head; the same sum, regrouped: sum_j p_j (c_j B_v) = (sum_j p_j c_j) B_v
        values = torch.einsum("bsr,rkd->bksd", latent_values, up)
        context = _attend(query, keys, values, mask, softmax_scale, softcap, scores)
    else:
        # values stay one latent shared by every KV head until after the reduction over slots
        context = _attend(query, keys, latent_values, mask, softmax_scale, softcap, scores)
        if up is None:
            return context.transpose(1, 2).reshape(batch, tokens, -1).to(query.dtype)
        context = torch.einsum("bkgtr,rkd->bkgtd", context.view(batch, num_kv_heads, group, tokens, rank_v), up)
    if bias_v is not None:
        context = context.view(batch, num_kv_heads, group, tokens, head_dim) + bias_v.float().view(
            1, num_kv_heads, 1, 1, head_dim)
    return context.reshape(batch, heads, tokens, head_dim).to(query.dtype)


def windowed_scores(query, keys, plain, query_positions, key_positions, inv_freq, rope_scale, window):
    """q k^T under windowed RoPE: a key at position p_j seen from a query at p_i scores as RoPE turns it (`keys`,
    at p_j) where p_i - p_j < window, else as if at p_i - window: <R(p_i) q, R(p_i - window) k> =
    <R(window - p_i) q_rot, k>, the query turned once and the key as the projection made it (`plain`, no RoPE).
    RoPE's scale multiplies the turned query as it multiplies the turned keys; channels past the rotary ones (partial
    rotary) are scored as they are, near or far.

    query: [batch, heads, tokens, head_dim] (RoPE applied); keys, plain: [batch, kv_heads, slots, head_dim];
    query_positions: [batch|1, tokens]; key_positions: [batch, slots] -> float32 [batch, heads, tokens, slots]
    (unscaled)."""
    batch, heads, tokens, head_dim = query.shape
    kv_heads = keys.shape[1]
    query_positions = torch.broadcast_to(query_positions, (batch, tokens)).long()
    cos, sin = rope_tables(window - query_positions, inv_freq, rope_scale, torch.float32)
    far_query = turn(query.float(), cos[:, None], sin[:, None])
    shape = (batch, kv_heads, heads // kv_heads, tokens, -1)
    rows = (batch, kv_heads, heads // kv_heads * tokens, head_dim)  # a KV head's queries as rows of one product
    near = (query.float().reshape(rows) @ keys.float().transpose(-1, -2)).view(shape)
    far = (far_query.reshape(rows) @ plain.float().transpose(-1, -2)).view(shape)
    behind = query_positions[:, :, None] - key_positions.long()[:, None]  # [batch, tokens, slots]
    scores = torch.where((behind >= window)[:, None, None], far, near)  # [batch, kv_heads, group, tokens, slots]
    return scores.reshape(batch, heads, tokens, -1)


def latent_scores(query, latents_k, up_k, bias_k, num_kv_heads):
    """q k^T without rebuilding any key, for sites with neither RoPE nor a key norm (Palu eq. 6): per KV head's
    block of B_k, q (c B_k + b_k)^T = (q B_k^T) c^T + q b_k^T. The query moves into latent space (rank_k
    channels) once per step; the slots are read as latents.

    query: [batch, heads, tokens, head_dim], latents_k: [batch, slots, rank_k] -> float32 [batch, heads, tokens,
    slots] (unscaled)."""
    batch, heads, tokens, head_dim = query.shape
    grouped = query.float().view(batch, num_kv_heads, heads // num_kv_heads, tokens, head_dim)
    absorbed = torch.einsum("bkgtd,rkd->bkgtr", grouped, up_k.float().view(-1, num_kv_heads, head_dim))
    # every head's latent queries as rows of one product: the latents are not copied per head
    scores = (absorbed.reshape(batch, heads * tokens, -1) @ latents_k.float().transpose(-1, -2)).view(
        batch, num_kv_heads, heads // num_kv_heads, tokens, -1)
    if bias_k is not None:
        scores = scores + (grouped * bias_k.float().view(1, num_kv_heads, 1, 1, head_dim)).sum(-1, keepdim=True)
    return scores.reshape(batch, heads, tokens, -1)


def _attend(query, keys, values, mask, softmax_scale, softcap=0.0, scores=None):
    """float32 attention of query [batch, heads, tokens, head_dim] over keys [batch, kv_heads, slots, head_dim] and
    values [batch, kv_heads, slots, *], or values [batch, slots, *]: one latent that every head shares. Scores are
    soft-capped when softcap > 0; `scores` (q k^T, float32 [batch, heads, tokens, slots]) stand for the keys where
    the caller has them. Each KV head's queries (and, for shared values, all heads) are rows of one product, so no
    key or value is copied per query head."""
    shared = values.dim() == 3
    if scores is None and not softcap and not shared:
        context = torch.nn.functional.scaled_dot_product_attention(
            query.float(), keys.float(), values, attn_mask=mask, scale=softmax_scale, enable_gqa=True)
        return context.nan_to_num(0.0)  # a query with no visible slot attends to nothing
    batch, heads, tokens, _ = query.shape
    if scores is None:
        kv_heads = keys.shape[1]
        rows = query.float().reshape(batch, kv_heads, heads // kv_heads * tokens, -1)
        scores = (rows @ keys.float().transpose(-1, -2)).view(batch, heads, tokens, -1)
    scores = scores * softmax_scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no visible slot attends to nothing
    if shared:
        return (weights.view(batch, heads * tokens, -1) @ values).view(batch, heads, tokens, -1)
    kv_heads = values.shape[1]
    return (weights.view(batch, kv_heads, heads // kv_heads * tokens, -1) @ values).view(batch, heads, tokens, -1)
