"""RankPlan: which rank and layout (bits, quantization group, rotation) each attention site's K and V latents
get, with the factors.

A plan is plain data: a frozen dataclass tree, validated when built and when loaded, saved as one
safetensors file (tensors + JSON metadata under the key "lrkv_plan", with a schema_version).
"""
import hashlib
import json
import numbers
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from lrkv_compile.lowering.quantize import QUANTIZED_BITS, packed_width
from lrkv_compile.passes.factorize import ROTATIONS, SCHEMES
from .errors import CorruptPlanError, LrkvWarning, PlanError
from .signature import SiteSignature

SCHEMA_VERSION = 5
# version 1: no layouts (16-bit latents); version 2: per-site RoPE groups (the cache stored cos/sin rows per
# slot), no sinks, window or context; version 3: no scale axis or outlier channels (every layout per token, none
# kept); version 4: no rope_window (exact RoPE; an lrkv that reads version 4 at most refuses a windowed plan
# rather than run it with exact RoPE). All are migrated on load.
READABLE_VERSIONS = (1, 2, 3, 4, 5)
POSITION_BYTES = 4  # a LatentCache stores each token's position (int32, one for all layers), not RoPE rows
DEFAULT_CONTEXT = 4096
SUPPORTED_BITS = (16,) + QUANTIZED_BITS
SCALE_AXES = ("token", "channel")
_TENSORS = ("down_k", "up_k", "down_v", "up_v")


@dataclass(frozen=True)
class Layout:
    """How one side's latents are stored in the cache (see `lowering/quantize.py` for the byte layout).

    bits: 16 = unquantized (the model's dtype), or 8, 4, 3, 2 bits per latent channel.
    group: how many values share one fp16 scale and zero point (quantized sides only): along the scale `axis`.
    axis: "token" (each token's latent channels in groups of `group`: the scales follow the token) or
    "channel" (each latent channel over blocks of `group` consecutive slots, as KIVI quantizes keys: a
    channel's range is shared by its tokens). A channel-axis block is quantized when its last slot is
    written; until then its tokens are read from the exact window, which must hold at least `group` slots
    (the residual KIVI keeps in full precision).
    rotation: the orthogonal rotation fused into the factors before quantization ("none", "hadamard",
    "orthogonal"); recorded here, applied by calibration (`passes.factorize.rotation`).
    outliers: the first `outliers` latent channels (the largest singular directions) are stored as float16
    and left out of the rotation and the quantization (STAR-KV's mixed-precision blocks); joint-scheme sides
    only (one block of latent channels).
    sinks: the first `sinks` tokens of a sequence are also kept exact (16-bit), as attention sinks (RotateKV,
    StreamingLLM); window: so are the most recent `window` slots after each step's write, this step's
    tokens included (KIVI's full-precision residual, which holds the newest tokens too; this step's tokens
    attend exactly anyway, so a decode step reads window - 1 earlier ones exact). Sinks are counted by slot:
    in a left-padded batch a shorter row's sinks are pad slots. Quantized sides only: the exact copies sit
    beside the quantized slots, which every token still has.
    """
    bits: int = 16
    group: int = 32
    rotation: str = "none"
    sinks: int = 0
    window: int = 0
    axis: str = "token"
    outliers: int = 0

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in SUPPORTED_BITS:
            raise PlanError(f"bits={self.bits!r}; choose one of {SUPPORTED_BITS} (16 = unquantized)")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise PlanError(f"group={self.group!r} must be a positive integer (latent channels per scale)")
        if self.rotation not in ROTATIONS:
            raise PlanError(f"rotation={self.rotation!r}; choose one of {ROTATIONS}")
        for name, what in (("sinks", "tokens kept exact"), ("window", "tokens kept exact"),
                           ("outliers", "latent channels kept in float16")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"{name}={value!r} must be an integer >= 0 ({what})")
        if self.bits == 16 and self.outliers:
            raise PlanError(f"outliers={self.outliers} with bits=16: every channel of a 16-bit side is stored exactly "
                            "already; outlier channels apply to quantized latents")
        if self.bits == 16 and (self.sinks or self.window):
            raise PlanError(f"sinks={self.sinks}, window={self.window} with bits=16: 16-bit latents are all stored "
                            "exactly already; sinks and a window apply to quantized latents")
        if self.axis not in SCALE_AXES:
            raise PlanError(f"axis={self.axis!r}; choose one of {SCALE_AXES} (what one quantization scale spans)")
        if self.axis == "channel" and self.bits == 16:
            raise PlanError("axis='channel' with bits=16: a scale axis applies to quantized latents only")
        if self.axis == "channel" and self.window < self.group:
            raise PlanError(f"axis='channel' with group={self.group} needs window >= {self.group}: a block of "
                            f"{self.group} slots is quantized once it is full, and until then its tokens are read "
                            f"from the exact window (window={self.window}); raise the window or lower the group")

    @property
    def exact_slots(self) -> int:
        """Tokens of this side held exact beside the quantized ones: the sinks, then a ring of the window."""
        return self.sinks + self.window

    def stored_widths(self, rank: int) -> tuple[int, int]:
        """Last dimensions of the (latents, scale) buffers a LatentCache holds for this side."""
        if self.bits == 16:
            return rank, 0
        quantized = rank - self.outliers
        return (2 * self.outliers + packed_width(quantized, self.bits),
                quantized if self.axis == "channel" else quantized // self.group)

    def scale_rows(self, slots: int) -> int:
        """Rows of the scale and zero buffers for `slots` cache slots: one per slot, or per channel-axis block."""
        return -(-slots // self.group) if self.axis == "channel" else slots

    def bytes_per_token(self, rank: int, context: int = DEFAULT_CONTEXT) -> float:
        """Cache bytes per token of a sequence of `context` tokens, counted against a 16-bit cache (2 bytes per
        16-bit value): the latents, an fp16 scale and zero point per group, and the exact sink and window
        tokens amortised over the context."""
        latents, scales = self.stored_widths(rank)
        per_token = (2 * latents if self.bits == 16 else latents) + 2 * 2 * scales * self.scale_rows(context) / context
        return per_token + 2 * rank * self.exact_slots / context


@dataclass(frozen=True)
class SitePlan:
    """One attention site: latent ranks and factors for its K and V projections.

    down_*: [hidden_size, rank]; up_*: [rank, num_kv_heads * head_dim], block diagonal over `*_blocks`.
    """
    layer: int
    k_weight: str
    v_weight: str
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    k_scheme: str
    v_scheme: str
    k_blocks: int
    v_blocks: int
    rank_k: int
    rank_v: int
    k_layout: Layout = Layout()
    v_layout: Layout = Layout()
    # weight_fingerprint of the K and V weights the factors were made from; () where unknown
    k_fingerprint: tuple = ()
    v_fingerprint: tuple = ()
    down_k: torch.Tensor = field(default=None, repr=False, compare=False)
    up_k: torch.Tensor = field(default=None, repr=False, compare=False)
    down_v: torch.Tensor = field(default=None, repr=False, compare=False)
    up_v: torch.Tensor = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise PlanError(f"site field {f.name}={value!r} must be an integer")
            if f.type in ("str", str) and not isinstance(value, str):
                raise PlanError(f"site field {f.name}={value!r} must be a string")
        for name in ("k_fingerprint", "v_fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)) or not all(isinstance(x, (int, float)) for x in value):
                raise PlanError(f"site field {name}={value!r} must be a list of numbers")
            object.__setattr__(self, name, tuple(float(x) for x in value))
        where = f"site {self.layer} ({self.k_weight})"
        kv_dim = self.num_kv_heads * self.head_dim
        for scheme_field in ("k_scheme", "v_scheme"):
            if getattr(self, scheme_field) not in SCHEMES:
                raise PlanError(f"{where}: {scheme_field}={getattr(self, scheme_field)!r}; expected one of {SCHEMES}")
        for side in ("k", "v"):
            layout = getattr(self, f"{side}_layout")
            if isinstance(layout, dict):  # from a plan file's metadata
                try:
                    layout = Layout(**layout)
                except PlanError as error:
                    raise PlanError(f"{where}: {side}_layout: {error}") from None
                object.__setattr__(self, f"{side}_layout", layout)
            if not isinstance(layout, Layout):
                raise PlanError(f"{where}: {side}_layout must be a Layout, got {type(layout).__name__}")
            rank = getattr(self, f"rank_{side}")
            if layout.outliers and (layout.outliers >= rank or getattr(self, f"{side}_blocks") != 1):
                raise PlanError(f"{where}: {side}_layout.outliers={layout.outliers} needs a joint-scheme side (one "
                                f"block of latent channels, not {getattr(self, f'{side}_blocks')}) with more than "
                                f"that many channels (rank_{side}={rank})")
            quantized = rank - layout.outliers
            if layout.bits != 16 and layout.axis == "token" and quantized % layout.group:
                raise PlanError(f"{where}: {side}_layout.group={layout.group} does not divide the {quantized} "
                                f"quantized channels of rank_{side}={rank} (outliers={layout.outliers}); pick a group "
                                "that divides them (a group larger than the rank is not allowed)")
        for side in ("k", "v"):
            rank, blocks = getattr(self, f"rank_{side}"), getattr(self, f"{side}_blocks")
            if not 1 <= rank <= min(self.hidden_size, kv_dim) or rank % blocks or kv_dim % blocks:
                raise PlanError(f"{where}: rank_{side}={rank} must be in [1, {min(self.hidden_size, kv_dim)}] "
                                f"and divisible by {side}_blocks={blocks}")
            down, up = getattr(self, f"down_{side}"), getattr(self, f"up_{side}")
            if not isinstance(down, torch.Tensor) or tuple(down.shape) != (self.hidden_size, rank):
                raise PlanError(f"{where}: down_{side} must be a tensor of shape {(self.hidden_size, rank)}, "
                                f"got {None if down is None else tuple(down.shape)}")
            if not isinstance(up, torch.Tensor) or tuple(up.shape) != (rank, kv_dim):
                raise PlanError(f"{where}: up_{side} must be a tensor of shape {(rank, kv_dim)}, "
                                f"got {None if up is None else tuple(up.shape)}")
            if not (torch.isfinite(down).all() and torch.isfinite(up).all()):
                raise PlanError(f"{where}: factors of {side.upper()} contain NaN or Inf")

    @property
    def signature(self) -> SiteSignature:
        return SiteSignature(self.k_weight, self.v_weight, self.hidden_size, self.num_kv_heads,
                             self.head_dim)

    @property
    def full_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def bytes_per_token(self, context: int = DEFAULT_CONTEXT) -> float:
        """Cache bytes per token of this site's latents at `context` tokens (16-bit values count 2 bytes)."""
        return self.k_layout.bytes_per_token(self.rank_k, context) + self.v_layout.bytes_per_token(self.rank_v, context)

    def metadata(self) -> dict:
        def plain(value):
            return list(value) if isinstance(value, tuple) else asdict(value) if isinstance(value, Layout) else value
        return {f.name: plain(getattr(self, f.name)) for f in fields(self) if f.name not in _TENSORS}


@dataclass(frozen=True)
class RankPlan:
    """A whole model's plan. `context`: the sequence length its budget is counted at (sinks and windows are
    amortised over it). `rope_window` (0: off): windowed RoPE (A2ATS): a cached token `rope_window` or more
    positions behind the query is scored as if exactly `rope_window` behind it, so the GPU kernel scores such
    tokens against their key latents without rebuilding and turning their keys. It changes what the model
    computes (an approximation that long-context studies find small for windows of a few hundred tokens and
    more: measure it with `lrkv eval --rope-window`), not what the cache stores, and needs a LatentCache."""
    sites: tuple
    source: str = "uniform"
    calibration_tokens: int = 0
    context: int = DEFAULT_CONTEXT
    rope_window: int = 0
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        _check_schema_version(self.schema_version, "schema_version")
        check_context(self.context)
        object.__setattr__(self, "rope_window", check_rope_window(self.rope_window))  # a plain int (JSON)
        if not self.sites:
            raise PlanError("a plan needs at least one site")
        previous = -1
        for position, site in enumerate(self.sites):
            if not isinstance(site, SitePlan):
                raise PlanError(f"sites[{position}] is a {type(site).__name__}, expected SitePlan")
            if site.layer <= previous:
                raise PlanError(f"sites[{position}].layer={site.layer} after layer {previous}; sites must be listed "
                                "in increasing layer order (layers a plan leaves out stay full)")
            previous = site.layer

    @property
    def keep(self) -> float:
        """Fraction of the K/V channels the latents keep (rank over full dimension, all sites)."""
        return sum(site.rank_k + site.rank_v for site in self.sites) / sum(2 * site.full_dim for site in self.sites)

    @property
    def budget(self) -> float:
        """`budget_at(self.context)`."""
        return self.budget_at(self.context)

    def budget_at(self, context: int) -> float:
        """Cache bytes of a sequence of `context` tokens over those of a 16-bit full K/V cache: latents, scales
        and zero points, exact sink and window tokens, and the tokens' positions. 16-bit sides count 2 bytes per
        value (a float32 model's cache holds them in float32: `LatentCache.nbytes()` shows it); every other
        buffer has the same bytes whatever the model's dtype."""
        check_context(context)
        stored = sum(site.bytes_per_token(context) for site in self.sites) + POSITION_BYTES
        return stored / sum(2 * 2 * site.full_dim for site in self.sites)

    def site_for(self, k_weight: str):
        return next((site for site in self.sites if site.k_weight == k_weight), None)

    def summary(self) -> str:
        ranks_k = sorted({s.rank_k for s in self.sites})
        ranks_v = sorted({s.rank_v for s in self.sites})
        schemes = sorted({f"{s.k_scheme}/{s.v_scheme}" for s in self.sites})
        bits = sorted({f"{s.k_layout.bits}/{s.v_layout.bits}" for s in self.sites})
        exact = sorted({f"{s.k_layout.sinks}+{s.k_layout.window}/{s.v_layout.sinks}+{s.v_layout.window}"
                        for s in self.sites})
        axes = sorted({f"{s.k_layout.axis}/{s.v_layout.axis}" for s in self.sites})
        outliers = sorted({f"{s.k_layout.outliers}/{s.v_layout.outliers}" for s in self.sites})
        return (f"RankPlan({len(self.sites)} sites, keep={self.keep:.3f}, budget={self.budget:.3f} of a 16-bit cache "
                f"at {self.context} tokens, K ranks {ranks_k}, V ranks {ranks_v}, K/V bits {bits}, "
                f"K/V scale axes {axes}, K/V float16 outlier channels {outliers}, K/V exact sinks+window {exact}, "
                f"K/V schemes {schemes}, {self.source}"
                + (f", windowed RoPE beyond {self.rope_window} tokens)" if self.rope_window else ")"))

    def save(self, path) -> None:
        """Write the plan as one safetensors file, with a checksum of its tensors in the metadata."""
        from safetensors.torch import save_file
        tensors = {f"sites.{i}.{name}": getattr(site, name).detach().cpu().contiguous().float()
                   for i, site in enumerate(self.sites) for name in _TENSORS}
        meta = {"schema_version": self.schema_version, "source": self.source, "context": self.context,
                "rope_window": self.rope_window, "calibration_tokens": self.calibration_tokens,
                "sites": [s.metadata() for s in self.sites]}
        meta["checksum"] = tensor_checksum(tensors, meta)
        save_file(tensors, str(path), metadata={"lrkv_plan": json.dumps(meta)})

    @classmethod
    def load(cls, path) -> "RankPlan":
        """Read a plan written by `save`; raises CorruptPlanError naming what is wrong."""
        from safetensors import safe_open
        path = Path(path)
        if not path.is_file():
            raise CorruptPlanError(f"{path}: no such plan file")
        try:
            with safe_open(str(path), framework="pt") as handle:
                raw = (handle.metadata() or {}).get("lrkv_plan")
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        except Exception as error:  # safetensors raises several types for damaged files
            raise CorruptPlanError(f"{path}: not a readable safetensors file ({error}); re-create the plan") from error
        if raw is None:
            raise CorruptPlanError(f"{path}: safetensors file without 'lrkv_plan' metadata; it is not an lrkv plan")
        try:
            meta = json.loads(raw)
            try:
                _check_schema_version(meta["schema_version"], "the file's schema_version", READABLE_VERSIONS)
            except PlanError as error:
                raise CorruptPlanError(f"{path}: {error}") from None
            checksum = meta.pop("checksum", None)
            if checksum is None:
                warnings.warn(f"{path}: this plan file has no checksum (written by lrkv 0.1.0), so damage to its "
                              "tensors cannot be detected; save it again to add one", LrkvWarning, stacklevel=2)
            elif checksum != tensor_checksum(tensors, meta):
                raise CorruptPlanError(f"{path}: the plan does not match the checksum written with it: the file was "
                                       "damaged or edited after saving; re-create the plan")
            if meta["schema_version"] == 1:
                meta = _migrate_v1(meta)
            if meta["schema_version"] == 2:
                meta = _migrate_v2(meta)
            if meta["schema_version"] == 3:  # its layouts load with the default scale axis, "token"
                meta = {**meta, "schema_version": 4}
            if meta["schema_version"] == 4:
                meta = {**meta, "schema_version": 5, "rope_window": 0}
            sites = []
            for i, site_meta in enumerate(meta["sites"]):
                factors = {}
                for name in _TENSORS:
                    key = f"sites.{i}.{name}"
                    if key not in tensors:
                        raise CorruptPlanError(f"{path}: tensor {key!r} is missing")
                    factors[name] = tensors[key]
                sites.append(SitePlan(**site_meta, **factors))
            return cls(sites=tuple(sites), source=meta["source"], calibration_tokens=meta["calibration_tokens"],
                       context=meta["context"], rope_window=meta["rope_window"])
        except CorruptPlanError:
            raise
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptPlanError(f"{path}: plan metadata is invalid ({error}); re-create the plan") from error

    @classmethod
    def uniform(cls, model, keep: float | None = None, **options) -> "RankPlan":
        """An uncalibrated plan (plain SVD of the weights): the same keep (default 0.5) for every site. Options as
        `lrkv.calibrate`."""
        from .calibrate import build_plan
        return build_plan(model, batches=None, keep=keep, **options)


def _check_schema_version(version, what: str, readable=(SCHEMA_VERSION,)) -> None:
    if isinstance(version, bool) or not isinstance(version, int):
        raise PlanError(f"{what}={version!r} must be an integer, {SCHEMA_VERSION} for plans this lrkv writes")
    if version not in readable:
        raise PlanError(f"{what}={version} is not readable by this lrkv, which reads schema_version "
                        f"{' or '.join(map(str, readable))}; use the lrkv release that wrote the plan, or re-create it")


def _migrate_v1(meta: dict) -> dict:
    """Version 1 sites carried bits_k / bits_v (always 16) instead of layouts."""
    sites = []
    for site in meta["sites"]:
        site = dict(site)
        site["k_layout"] = {"bits": site.pop("bits_k", 16)}
        site["v_layout"] = {"bits": site.pop("bits_v", 16)}
        sites.append(site)
    return {**meta, "schema_version": 2, "sites": sites}


def _migrate_v2(meta: dict) -> dict:
    """Version 2 sites carried a RoPE group (the cache stored cos/sin rows per slot, now positions) and the plan
    no context (its budget was per token, with no sinks or window to amortise)."""
    sites = [{name: value for name, value in site.items() if name != "rope_group"} for site in meta["sites"]]
    return {**meta, "schema_version": 3, "context": DEFAULT_CONTEXT, "sites": sites}


def weight_fingerprint(weight: torch.Tensor) -> tuple:
    """Eight numbers that identify a projection weight [out, in] whatever its dtype or device:
    P_out W p_in with fixed, deterministic probes. bf16 rounding moves them by ~1e-4 (relative); another
    checkpoint of the same shapes (a fine-tune, a sibling) by far more."""
    w = weight.detach().double().cpu()
    out_dim, in_dim = w.shape
    probe_in = torch.sin(torch.arange(in_dim, dtype=torch.float64) * 1.618 + 1.0)
    rows = torch.arange(1, 9, dtype=torch.float64)[:, None]
    probe_out = torch.sin(torch.arange(out_dim, dtype=torch.float64)[None] * 0.618 * rows + rows)
    return tuple(float(x) for x in probe_out @ (w @ probe_in))


def tensor_checksum(tensors: dict, meta: dict) -> str:
    """sha256 over the canonical JSON of `meta` and the names, dtypes, shapes and bytes of `tensors`."""
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return "sha256:" + digest.hexdigest()


def check_context(context) -> int:
    """`context` as a positive int, or a PlanError naming the user's value."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise PlanError(f"context={context!r} must be a positive integer: the sequence length (tokens) a budget is "
                        "counted at")
    return context


def check_rope_window(window) -> int:
    """A plan's rope_window: 0 (exact RoPE) or a positive number of tokens."""
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise PlanError(f"rope_window={window!r} must be 0 (exact RoPE) or a positive number of tokens")
    return int(window)


def check_keep(keep, name: str = "keep") -> float:
    """`keep` as a float in (0, 1], or a PlanError naming the user's value."""
    if isinstance(keep, bool) or not isinstance(keep, numbers.Real):
        raise PlanError(f"{name}={keep!r} must be a number in (0, 1], the fraction of the K/V cache kept")
    if not 0 < keep <= 1:
        raise PlanError(f"{name}={keep}: must be in (0, 1], the fraction of the K/V cache kept")
    return float(keep)


def rank_for(keep: float, full_dim: int, hidden_size: int, multiple: int) -> int:
    """The rank a `keep` fraction gives: a multiple of `multiple` (the scheme's blocks, and for quantized
    latents the quantization group), at least one such multiple."""
    keep = check_keep(keep)
    cap = min(full_dim, hidden_size)
    return max(1, min(cap // multiple, round(keep * full_dim / multiple))) * multiple

