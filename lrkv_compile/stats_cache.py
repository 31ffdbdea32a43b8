"""Calibration statistics kept on disk, so that a second plan from the same model and text (another budget, the
CLI's calibrate after its eval, a plan carried over beside one calibrated directly) skips the pass over the text.

An entry is named by a SHA-256 of everything the statistics depend on: the model's class, config and every weight
and buffer, the token ids row by row, whether loss gradients were taken, the device type, the torch and
transformers versions, and the source of the modules that trace the model and record the statistics (so an
edited lrkv never reads statistics an older one recorded). It lives under `$LRKV_STATS_CACHE`, else the
`stats` folder of lrkv's cache (`lrkv_compile.models.cache_root`); LRKV_STATS_CACHE=off keeps nothing. Deleting
it is always safe.
"""
import contextlib
import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from .errors import LrkvWarning

FORMAT = 1  # bump when what an entry holds changes
_SOURCES = ("calibrate.py", "trace.py", "passes/sites.py", "passes/patterns.py", "passes/canonicalize.py")


def folder() -> Path | None:
    """The statistics folder, or None when LRKV_STATS_CACHE=off."""
    setting = os.environ.get("LRKV_STATS_CACHE")
    if setting and setting.lower() == "off":
        return None
    if setting:
        return Path(setting)
    from .models import cache_root
    return cache_root() / "stats"


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())


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
    for name in _SOURCES:
        add((here / name).read_bytes())
    config = getattr(model, "config", None)
    add(FORMAT, torch.__version__, transformers.__version__, type(model).__qualname__,
        config.to_json_string() if hasattr(config, "to_json_string") else None, fisher, samples,
        next(model.parameters()).device.type)
    try:
        for name, tensor in model.state_dict().items():
            add(name, str(tensor.dtype), tuple(tensor.shape), _tensor_bytes(tensor))
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
            if json.loads(meta["sites"]) != _names(sites) or json.loads(meta["fisher"]) != fisher:
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
    meta = {"sites": json.dumps(_names(stats.sites)), "fisher": json.dumps(stats.fisher is not None),
            "tokens": str(stats.tokens), "format": str(FORMAT)}
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, partial, metadata=meta)
        os.replace(partial, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        warnings.warn(f"lrkv: could not keep the calibration statistics in {path.parent} ({error}); set "
                      "LRKV_STATS_CACHE to a writable folder, or to off", LrkvWarning, stacklevel=3)
