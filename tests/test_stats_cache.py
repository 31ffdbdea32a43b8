"""The calibration statistics cache: the same model and text read back what was collected, anything else is
collected again, and a damaged or unwritable cache is said, never a wrong answer."""
import warnings

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

import lrkv_compile as lrkv
from lrkv_compile import stats_cache, zoo
from lrkv_compile.calibrate import _Recorder, collect_stats
from lrkv_compile.transfer import latent_share


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LRKV_STATS_CACHE", str(tmp_path / "stats"))
    return tmp_path / "stats"


def _model(seed=1):
    return zoo.build("llama", layers=3, heads=4, kv_heads=2, head_dim=16, seed=seed)


def _rows(seed=0, shape=(2, 24)):
    return torch.randint(3, zoo.VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _runs(monkeypatch):
    """A list that grows by one each time a calibration row goes through the model."""
    calls, record = [], _Recorder.record

    def counted(self, site_index, x):
        if site_index == 0:
            calls.append(x.shape)
        return record(self, site_index, x)

    monkeypatch.setattr(_Recorder, "record", counted)
    return calls


def _same(a, b):
    assert a.tokens == b.tokens
    assert [s.k_weight for s in a.sites] == [s.k_weight for s in b.sites]
    for x, y in zip(a.grams, b.grams):
        assert torch.equal(x, y)
    assert (a.fisher is None) == (b.fisher is None)
    if a.fisher is not None:
        assert a.fisher.keys() == b.fisher.keys()
        assert all(torch.equal(a.fisher[key], b.fisher[key]) for key in a.fisher)
        assert all(torch.equal(x, y) for x, y in zip(a.samples, b.samples))


@pytest.mark.parametrize("fisher", [False, True])
def test_the_same_model_and_text_read_back_what_was_collected(folder, monkeypatch, fisher):
    model, rows = _model(), _rows()
    runs = _runs(monkeypatch)
    first = collect_stats(model, rows, progress=False, fisher=fisher)
    assert len(runs) == 2 and len(list(folder.glob("*.safetensors"))) == 1
    again = collect_stats(model, rows, progress=False, fisher=fisher)
    assert len(runs) == 2  # nothing went through the model a second time
    _same(first, again)
    # and a plan made from them is the plan made from fresh statistics
    options = dict(budget=0.3) if fisher else dict(keep=0.5)
    kept = lrkv.calibrate(model, stats=again, progress=False, **options)
    fresh = lrkv.calibrate(model, stats=collect_stats(model, rows, progress=False, fisher=fisher, cache=False),
                           progress=False, **options)
    assert [(s.rank_k, s.rank_v, s.k_layout, s.v_layout) for s in kept.sites] == \
        [(s.rank_k, s.rank_v, s.k_layout, s.v_layout) for s in fresh.sites]
    assert all(torch.equal(a.down_k, b.down_k) and torch.equal(a.up_v, b.up_v) for a, b in zip(kept.sites, fresh.sites))


def test_other_weights_text_or_gradients_are_collected_again(folder, monkeypatch):
    model = _model()
    runs = _runs(monkeypatch)
    collect_stats(model, _rows(), progress=False)
    collect_stats(model, _rows(seed=1), progress=False)  # other text
    collect_stats(model, _rows(), progress=False, fisher=True)  # with gradients
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] += 1e-3  # one weight moved
    collect_stats(model, _rows(), progress=False)
    collect_stats(_model(seed=2), _rows(), progress=False)  # another model of the same shapes
    assert len(runs) == 10
    assert len(list(folder.glob("*.safetensors"))) == 5


def test_a_damaged_entry_is_said_and_collected_again(folder, monkeypatch):
    model, rows = _model(), _rows()
    first = collect_stats(model, rows, progress=False, fisher=True)
    (entry,) = folder.glob("*.safetensors")
    entry.write_bytes(entry.read_bytes()[:1000])
    runs = _runs(monkeypatch)
    with pytest.warns(lrkv.LrkvWarning, match="do not read back"):
        again = collect_stats(model, rows, progress=False, fisher=True)
    assert len(runs) == 2
    _same(first, again)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(first, collect_stats(model, rows, progress=False, fisher=True))  # replaced: reads back now
    assert len(runs) == 2


def test_another_attention_implementation_or_sites_are_not_read_back(folder, monkeypatch):
    model, rows = _model(), _rows()
    stats = collect_stats(model, rows, progress=False)
    sdpa = stats_cache.entry(model, [row[None] for row in rows], False, 512)
    model.config._attn_implementation = "eager"
    assert stats_cache.entry(model, [row[None] for row in rows], False, 512) != sdpa
    assert stats_cache.load(sdpa, stats.sites, False) is not None
    other = collect_stats(zoo.build("llama", layers=2, heads=4, kv_heads=2, head_dim=16, seed=1), rows,
                          progress=False, cache=False)
    with pytest.warns(lrkv.LrkvWarning, match="do not read back .* other attention sites"):
        assert stats_cache.load(sdpa, other.sites, False) is None


def test_off_keeps_nothing_and_an_unwritable_folder_is_said(tmp_path, monkeypatch):
    model, rows = _model(), _rows()
    monkeypatch.setenv("LRKV_STATS_CACHE", "off")
    runs = _runs(monkeypatch)
    collect_stats(model, rows, progress=False)
    collect_stats(model, rows, progress=False)
    assert len(runs) == 4
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("LRKV_STATS_CACHE", str(blocked / "stats"))
    with pytest.warns(lrkv.LrkvWarning, match="could not keep the calibration statistics"):
        stats = collect_stats(model, rows, progress=False)
    assert stats.tokens == rows.numel()
    # a file the writer cannot write (safetensors' own error: read-only, full disk) is said, and no part is left
    monkeypatch.setenv("LRKV_STATS_CACHE", str(tmp_path / "stats"))

    def failing(tensors, filename, metadata=None):
        with open(filename, "wb") as file:
            file.write(b"half")
        raise SafetensorError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.warns(lrkv.LrkvWarning, match="could not keep the calibration statistics .*No space left"):
        assert collect_stats(model, rows, progress=False).tokens == rows.numel()
    assert list((tmp_path / "stats").iterdir()) == []
    # weights that cannot be read as bytes (offloaded, a quantized subclass) are said, and nothing is kept
    monkeypatch.setenv("LRKV_STATS_CACHE", str(tmp_path / "stats2"))

    def unreadable(tensor):
        raise NotImplementedError("a tensor subclass")

    monkeypatch.setattr(stats_cache, "_tensor_bytes", unreadable)
    with pytest.warns(lrkv.LrkvWarning, match="statistics not kept: the weight .* cannot be read"):
        assert collect_stats(model, rows, progress=False).tokens == rows.numel()
    assert not (tmp_path / "stats2").exists()


def test_transfer_takes_the_statistics_a_calibration_shares(folder):
    source = lrkv.calibrate(_model(), _rows(), budget=0.25, progress=False)
    target = zoo.build("qwen3", layers=2, heads=4, kv_heads=2, head_dim=32, seed=2)
    stats = collect_stats(target, _rows(seed=3, shape=(2, 64)), progress=False, fisher=True)
    carried = lrkv.transfer(source, target, stats=stats, show=False, progress=False)
    direct = lrkv.calibrate(target, stats=stats, budget=source.budget, method="uniform", progress=False)
    assert len(carried.sites) == len(direct.sites) == 2
    assert 0.8 * latent_share(source) < latent_share(carried) <= latent_share(source)
    assert carried.calibration_tokens == direct.calibration_tokens == 128
    with pytest.raises(lrkv.PlanError, match="one of the two"):
        lrkv.transfer(source, target, _rows(), stats=stats, show=False)
    with pytest.raises(lrkv.PlanError, match="one of the two"):
        lrkv.transfer(source, target, show=False)
    with pytest.raises(lrkv.PlanError, match="without fisher=True"):
        lrkv.transfer(source, target, stats=collect_stats(target, _rows(), progress=False), show=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool, torch.uint8])
def test_the_fingerprint_of_a_gpu_weight_names_its_bytes(dtype):
    """A CUDA model's weights are named by `fingerprint`, computed on the GPU; here on CPU tensors, the same arithmetic:
    a copy gives the same 16 bytes, and one element changed (by 1e-3 for floats, a flipped bit for the rest), two
    elements swapped, or a change in the last bytes of a length that is not a multiple of 8 words give others."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(2 * 1000 + 3, generator=generator)
    tensor = (base > 0) if dtype is torch.bool else (base * 50).to(dtype)
    print_ = stats_cache.fingerprint(tensor)
    assert len(print_) == 16 and stats_cache.fingerprint(tensor.clone()) == print_
    changed = []
    for at in (7, tensor.numel() - 1):
        other = tensor.clone()
        if dtype.is_floating_point:
            other[at] += 1e-3 if dtype is torch.float32 else 1.0
        else:
            other[at] = ~other[at] if dtype is torch.bool else other[at] ^ 1
        changed.append(other)
    swapped = tensor.clone()
    first, second = 0, next(i for i in range(1, tensor.numel()) if tensor[i] != tensor[0])
    swapped[first], swapped[second] = tensor[second], tensor[first]
    changed.append(swapped)
    assert all(stats_cache.fingerprint(other) != print_ for other in changed)
    assert len({stats_cache.fingerprint(other) for other in changed}) == len(changed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a model on a GPU (its weights named by fingerprint on the "
                                                          "GPU; the arithmetic is checked on CPU tensors above)")
def test_a_model_on_the_gpu_reads_back_without_copying_its_weights(folder, monkeypatch):
    model, rows = _model().cuda(), _rows().cuda()
    for tensor in model.state_dict().values():  # the same 16 bytes on either device
        assert stats_cache.fingerprint(tensor) == stats_cache.fingerprint(tensor.cpu())
    copied = []
    bytes_of = stats_cache._tensor_bytes
    monkeypatch.setattr(stats_cache, "_tensor_bytes",
                        lambda tensor: copied.append(tensor.is_cuda and tensor.is_floating_point()) or bytes_of(tensor))
    runs = _runs(monkeypatch)
    first = collect_stats(model, rows, progress=False)
    _same(first, collect_stats(model, rows, progress=False))
    assert len(runs) == 2 and True not in copied  # read back; no float weight went to the host to be named
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1e-3
    collect_stats(model, rows, progress=False)
    assert len(runs) == 4 and len(list(folder.glob("*.safetensors"))) == 2
