"""`dataset.name: huggingface` on small datasets written with `save_to_disk` here (no network): images and
features, ClassLabel and plain int labels, split choice and pooling, one-line errors, and a CLI run."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.data.sources import load_dataset
from raysim.errors import DataError
from tests.support.data_files import datasets, save_dataset, tabular_dataset

CLASSES = ["cat", "dog", "fox"]


def _images(n: int, mode: str = "RGB", sizes: tuple[int, ...] = (8,), offset: int = 0) -> list:
    """n small images whose pixel value encodes the row (offset + row) so order can be checked."""
    from PIL import Image

    channels = 3 if mode == "RGB" else 1
    pictures = []
    for row in range(n):
        side = sizes[row % len(sizes)]
        pixels = np.full((side, side, channels), (offset + row) % 256, dtype=np.uint8)
        pictures.append(Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode))
    return pictures


def _image_set(n: int = 60, mode: str = "RGB", sizes: tuple[int, ...] = (8,), offset: int = 0):
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    return datasets.Dataset.from_dict(
        {"img": _images(n, mode, sizes, offset), "label": [row % 3 for row in range(n)]}, features=features
    )


def test_image_dataset_loads_as_uint8_with_classlabel_classes_and_channel_stats(tmp_path):
    path = save_dataset(_image_set(60), tmp_path / "pets")
    data = load_dataset("huggingface", path=path, image="img")
    assert data.x.dtype == np.uint8 and data.x.shape == (60, 3, 8, 8)
    assert data.y.dtype == np.int64 and data.y.tolist() == [row % 3 for row in range(60)]
    assert data.num_classes == 3 and data.task == "classification"
    assert np.all(data.x[:, :, 0, 0] == np.arange(60)[:, None])
    values = np.arange(60) / 255.0
    assert data.mean == pytest.approx((values.mean(),) * 3, rel=1e-6)
    assert data.std == pytest.approx((values.std(),) * 3, rel=1e-6)


def test_grayscale_images_have_one_channel_and_mixed_sizes_need_size(tmp_path):
    gray = save_dataset(_image_set(12, mode="L"), tmp_path / "gray")
    data = load_dataset("huggingface", path=gray, image="img")
    assert data.x.shape == (12, 1, 8, 8) and len(data.mean) == 1 and len(data.std) == 1

    mixed = save_dataset(_image_set(12, sizes=(8, 6)), tmp_path / "mixed")
    with pytest.raises(DataError) as error:
        load_dataset("huggingface", path=mixed, image="img")
    message = str(error.value)
    assert "\n" not in message and message.startswith("dataset.image:") and "'img'" in message
    assert "dataset.size" in message
    resized = load_dataset("huggingface", path=mixed, image="img", size=5)
    assert resized.x.shape == (12, 3, 5, 5) and resized.x.dtype == np.uint8


def test_dataset_dict_split_selection_and_pooling_train_then_test(tmp_path):
    splits = datasets.DatasetDict(
        {"validation": _image_set(6, offset=200), "test": _image_set(10, offset=100), "train": _image_set(20)}
    )
    path = save_dataset(splits, tmp_path / "splits")
    test = load_dataset("huggingface", path=path, split="test", image="img")
    assert len(test) == 10 and test.x[0, 0, 0, 0] == 100
    pooled = load_dataset("huggingface", path=path, image="img")
    assert len(pooled) == 36 and pooled.num_classes == 3
    first_pixels = pooled.x[:, 0, 0, 0].tolist()
    assert first_pixels == [*range(20), *range(100, 110), *range(200, 206)]  # train, test, then the rest by name
    with pytest.raises(DataError, match=r"^dataset\.split: .* no split 'dev'; its splits: train, test, validation$"):
        load_dataset("huggingface", path=path, split="dev", image="img")


def test_tabular_dataset_gives_float_features_and_max_plus_one_classes(tmp_path):
    table = tabular_dataset(90)
    path = save_dataset(table, tmp_path / "tabular")
    data = load_dataset("huggingface", path=path, image="features", label="target")
    assert data.x.dtype == np.float32 and data.x.shape == (90, 10)
    assert np.allclose(data.x, np.asarray(table["features"], dtype=np.float32))
    assert data.y.dtype == np.int64 and data.num_classes == int(max(table["target"])) + 1
    assert data.mean is None and data.std is None


def test_a_missing_column_names_the_field_and_lists_the_columns(tmp_path):
    path = save_dataset(tabular_dataset(20), tmp_path / "tabular")
    for options, field in (({"label": "target"}, "image"), ({"image": "features"}, "label")):
        with pytest.raises(DataError) as error:
            load_dataset("huggingface", path=path, **options)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"dataset.{field}:")
        assert "its columns: features, target" in message
    with pytest.raises(DataError, match=r"^dataset\.split: .* holds one dataset \(split unnamed\)"):
        load_dataset("huggingface", path=path, split="train", image="features", label="target")


def test_a_path_neither_saved_nor_on_the_hub_is_one_line_naming_dataset_path(tmp_path, monkeypatch):
    """Offline mode makes the hub lookup fail at once (else it retries for about 25 s without network)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for path in ("no-such-user/no-such-dataset", str(tmp_path / "missing")):
        with pytest.raises(DataError) as error:
            load_dataset("huggingface", root=str(tmp_path / "cache"), path=path)
        message = str(error.value)
        assert "\n" not in message and message.startswith("dataset.path:")
        assert "neither a folder written by save_to_disk nor reachable on the Hugging Face hub" in message
