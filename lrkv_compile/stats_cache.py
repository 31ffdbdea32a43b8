"""Calibration statistics kept on disk, so that a second plan from the same model and text (another budget, the
CLI's calibrate after its eval, a rerun) skips the pass over the text.

An entry is named by a SHA-256 of everything the statistics depend on: the model's class and the source file that
defines it, its config and attention implementation, train or eval mode, every parameter and buffer (on a GPU through
their `fingerprint`, computed there), the token ids
row by row, whether loss gradients were taken, the device type, the torch and transformers versions, and lrkv's own
source (so an edited lrkv never reads statistics an older one recorded). It lives under `$LRKV_STATS_CACHE`, else
the `stats` folder of lrkv's cache (`lrkv_compile.models.cache_root`); LRKV_STATS_CACHE=off keeps nothing. An
entry takes 8 hidden^2 bytes a layer for the input Gram matrices (SmolLM2 with gradients about 120 MB, a 7B Llama
about 4.3 GB). Deleting it is always safe.
"""
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from .errors import LrkvWarning

FORMAT = 1  # bump when what an entry holds changes


def folder() -> Path | None:
    """The statistics folder, or None when LRKV_STATS_CACHE=off."""
    setting = os.environ.get("LRKV_STATS_CACHE")
    if setting and setting.lower() == "off":
        return None
    if setting:
        return Path(setting)
    from .models import cache_root
    return cache_root() / "stats"


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as one uint8 tensor on its own device."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(_flat_bytes(tensor).cpu().numpy())


_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as signed 64-bit integers
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_CHUNK = 1 << 22  # words at a time


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >>> bits on 64-bit words held as signed integers (torch's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def fingerprint(tensor: torch.Tensor) -> bytes:
    """16 bytes that name a tensor's bytes, computed where the tensor lives: two sums mod 2^64 of its 64-bit words,
    each word times a pseudo-random odd key (splitmix64 of its index, one stream per sum). Any change of one word
    changes both sums (the keys are odd); a change of several words leaves a sum unchanged only if it cancels under
    the fixed keys, about once in 2^64 for changes not built against them. A CUDA model's weights are named so
    without copying them to the host: over 4.3 GB of float16 weights on an H200, 0.10 s against 6.1 s for the copy
    and SHA-256 (a 7B model's 14 GB: about 20 s on each call of `collect_stats`, twice in a transfer)."""
    data = _flat_bytes(tensor)
    if data.numel() % 8:
        data = torch.cat([data, data.new_zeros(8 - data.numel() % 8)])
    words = data.view(torch.int64)
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start:start + _CHUNK]
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=words.device)
        for stream in range(2):
            sums[stream] += (part * (_splitmix(2 * index + stream) | 1)).sum()
    return sums.cpu().numpy().tobytes()


def entry(model, rows: list, fisher: bool, samples: int) -> Path | None:
    """The file that holds (or will hold) the statistics of `model` over `rows` ([1, tokens] tensors)."""
    root = folder()
    if root is None:
        return None
    import transformers
    digest = hashlib.sha256()

    def add(*parts):
        for part in parts:
            digest.update(part if isinstance(part, (bytes, memoryview)) else repr(part).encode())
            digest.update(b"\0")

    here = Path(__file__).parent
    for source in sorted(here.glob("**/*.py")):  # lrkv's own code: the trace, the recorder, the rotary graph
        add(source.relative_to(here).as_posix(), source.read_bytes())
    model_file = getattr(sys.modules.get(type(model).__module__), "__file__", None)  # the model's own forward
    config = getattr(model, "config", None)
    add(FORMAT, torch.__version__, transformers.__version__, type(model).__module__, type(model).__qualname__,
        Path(model_file).read_bytes() if model_file else None,
        config.to_json_string() if hasattr(config, "to_json_string") else None,
        getattr(config, "_attn_implementation", None), model.training, fisher, samples,
        next(model.parameters()).device.type)
    name = None
    try:
        for name, tensor in [*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)]:
            add(name, str(tensor.dtype), tuple(tensor.shape),
                fingerprint(tensor) if tensor.is_cuda else _tensor_bytes(tensor))
    except Exception as error:  # weights that are not plain tensors (offloaded, quantized subclasses)
        warnings.warn(f"lrkv: calibration statistics not kept: the weight {name} cannot be read to name them "
                      f"({type(error).__name__}: {error})", LrkvWarning, stacklevel=3)
        return None
    for row in rows:
        add(tuple(row.shape), _tensor_bytes(row.long()))
    return root / f"{type(model).__name__}-{digest.hexdigest()[:24]}.safetensors"


def _names(sites) -> list:
    return [[site.k_weight, site.v_weight] for site in sites]


def load(path: Path, sites, fisher: bool) -> dict | None:
    """{grams, tokens, fisher, samples} for CalibrationStats from `path`, or None where there is no entry. An
    entry that does not read back, or holds other sites than `sites`, is said and left to be written again."""
    if path is None or not path.exists():
        return None
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as file:
            meta = file.metadata()
            if json.loads(meta["sites"]) != _names(sites):
                raise ValueError("it holds other attention sites")
            found = {
                "grams": [file.get_tensor(f"gram.{site.index}") for site in sites],
                "tokens": int(meta["tokens"]),
                "fisher": ({(site.index, side): file.get_tensor(f"fisher.{site.index}.{side}")
                            for site in sites for side in ("k", "v")} if fisher else None),
                "samples": [file.get_tensor(f"samples.{site.index}") for site in sites] if fisher else None,
            }
        for site, gram in zip(sites, found["grams"]):
            if tuple(gram.shape) != (site.hidden_size, site.hidden_size) or gram.dtype != torch.float64:
                raise ValueError(f"site {site.index}'s statistics have shape {tuple(gram.shape)}")
        return found
    except Exception as error:  # a damaged entry: collected again and replaced
        warnings.warn(f"lrkv: the calibration statistics in {path} do not read back ({type(error).__name__}: "
                      f"{error}); collecting them again", LrkvWarning, stacklevel=3)
        return None


def save(path: Path, stats) -> None:
    """Write `stats` (a CalibrationStats) to `path` whole or not at all; a folder that cannot be written is said."""
    from safetensors.torch import save_file
    tensors = {f"gram.{site.index}": stats.grams[site.index] for site in stats.sites}
    if stats.fisher is not None:
        tensors.update({f"fisher.{index}.{side}": matrix for (index, side), matrix in stats.fisher.items()})
        tensors.update({f"samples.{site.index}": stats.samples[site.index].contiguous() for site in stats.sites})
    meta = {"sites": json.dumps(_names(stats.sites)), "tokens": str(stats.tokens), "format": str(FORMAT)}
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        os.close(handle)
        save_file(tensors, partial, metadata=meta)
        os.replace(partial, path)
        partial = None
    except Exception as error:  # OSError, or safetensors' own error for a file it cannot write
        warnings.warn(f"lrkv: could not keep the calibration statistics in {path.parent} ({type(error).__name__}: "
                      f"{error}); set LRKV_STATS_CACHE to a writable folder, or to off", LrkvWarning, stacklevel=3)
    finally:
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
