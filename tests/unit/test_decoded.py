"""Decoded copies of dataset files (raysim.data.decoded): written once, mapped after, renewed when a source changes,
never left half-written, and the installed Fashion-MNIST the same through its copy as decoded."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.data.decoded import decoded
from raysim.data.fashion_mnist import FashionMnistSettings


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "decoded"


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "source.bin"
    path.write_bytes(b"\x01\x02\x03")
    return path


class Decoder:
    """Counts its calls; its arrays depend on the source's bytes."""

    def __init__(self, source):
        self.source, self.calls = source, 0

    def __call__(self):
        self.calls += 1
        raw = np.frombuffer(self.source.read_bytes(), np.uint8)
        return raw.reshape(1, -1).copy(), np.arange(len(raw), dtype=np.int64)


def test_the_first_load_decodes_and_writes_the_next_maps_the_same_arrays_read_only(cache, source):
    decoder = Decoder(source)
    first = decoded("thing", [source], ("x", "y"), decoder)
    second = decoded("thing", [source], ("x", "y"), decoder)
    assert decoder.calls == 1
    assert sorted(path.name.split("-", 1)[1] for path in cache.iterdir()) == ["x.npy", "y.npy"]
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype and not a.flags.writeable and not b.flags.writeable
        assert type(b) is np.ndarray  # not np.memmap: what the loaders hand on is a plain array
    with pytest.raises(ValueError, match="read-only"):
        second[0][0, 0] = 9


def test_a_changed_source_is_decoded_again_and_a_different_name_is_another_copy(cache, source):
    decoder = Decoder(source)
    decoded("thing", [source], ("x", "y"), decoder)
    source.write_bytes(b"\x05\x06\x07\x08")  # another size (and time)
    x, _ = decoded("thing", [source], ("x", "y"), decoder)
    assert decoder.calls == 2 and x.tolist() == [[5, 6, 7, 8]]
    decoded("other", [source], ("x", "y"), decoder)
    assert decoder.calls == 3 and len(list(cache.iterdir())) == 6


def test_a_damaged_copy_is_decoded_again_and_rewritten(cache, source, caplog):
    decoder = Decoder(source)
    decoded("thing", [source], ("x", "y"), decoder)
    damaged = next(cache.glob("*-x.npy"))
    damaged.write_bytes(damaged.read_bytes()[:20])
    x, _ = decoded("thing", [source], ("x", "y"), decoder)
    assert decoder.calls == 2 and x.tolist() == [[1, 2, 3]] and "unreadable" in caplog.text
    x, _ = decoded("thing", [source], ("x", "y"), decoder)
    assert decoder.calls == 2 and x.tolist() == [[1, 2, 3]]


def test_a_copy_that_cannot_be_written_leaves_nothing_and_the_load_goes_on(cache, source):
    decoder = Decoder(source)
    decoded("thing", [source], ("x", "y"), decoder)
    names = sorted(path.name for path in cache.iterdir())
    for path in cache.iterdir():
        path.unlink()
    (cache / names[0]).mkdir()  # x's final name taken by a folder: renaming its copy into place fails
    x, y = decoded("thing", [source], ("x", "y"), decoder)
    assert decoder.calls == 2 and x.tolist() == [[1, 2, 3]] and y.tolist() == [0, 1, 2]
    assert sorted(path.name for path in cache.iterdir()) == [names[0]]  # no temporary left, no y without its x


def test_fashion_mnist_through_its_copy_is_what_decoding_its_files_gives(cache):
    settings = FashionMnistSettings(download=False)
    first = settings.load(0)
    assert len(list(cache.glob("*.npy"))) == 2
    mapped = settings.load(0)
    np.testing.assert_array_equal(first.x, mapped.x)
    np.testing.assert_array_equal(first.y, mapped.y)
    assert mapped.x.shape == (70_000, 1, 28, 28) and mapped.x.dtype == np.uint8 and mapped.y.dtype == np.int64
