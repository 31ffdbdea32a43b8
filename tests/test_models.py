"""Models from GGUF files: converted once, then read from lrkv's cache."""
import pytest
import torch

from lrkv_compile import models

pytestmark = pytest.mark.slow


def test_a_gguf_model_is_converted_once_and_read_back_from_the_cache_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("LRKV_CACHE", str(tmp_path))
    converted, tokenizer = models.load_smollm2()
    entries = list((tmp_path / "models").iterdir())
    assert len(entries) == 1 and (entries[0] / "complete").exists(), entries
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = converted(ids).logits

    cached, cached_tokenizer = models.load_smollm2()
    assert cached_tokenizer(text, return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():
        torch.testing.assert_close(cached(ids).logits, expected, rtol=0, atol=0)
    assert cached.dtype == torch.float32 and models.load_smollm2(torch.float16)[0].dtype == torch.float16

    # a damaged entry is said, converted again and replaced, never read as it is; the conversion is the one above
    # (a second would take its 30-40 s again)
    import transformers
    read = transformers.AutoModelForCausalLM.from_pretrained
    conversions = []

    def convert(*args, **kwargs):
        if "gguf_file" not in kwargs:
            return read(*args, **kwargs)
        conversions.append(kwargs["gguf_file"])
        return converted
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", convert)
    weights = next(entries[0].glob("*.safetensors"))
    weights.write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match="does not load"):
        models.load_smollm2()
    assert [entry.name for entry in (tmp_path / "models").iterdir()] == [entries[0].name]
    replaced, _ = models.load_smollm2()  # the replaced entry loads, as it was converted
    assert conversions == [models.smollm2_path().name]
    with torch.no_grad():
        torch.testing.assert_close(replaced(ids).logits, expected, rtol=0, atol=0)
