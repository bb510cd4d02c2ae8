"""File-backed image datasets (MedMNIST .npz, ImageFolder, Tiny-ImageNet, LEAF FEMNIST) read from small files
written here in each publisher's real layout, plus two runs through the CLI and a download from a local server."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from raysim.data import image_folder as image_folder_module
from raysim.data import medmnist as medmnist_module
from raysim.data.sources import load_dataset
from raysim.errors import ConfigError, DataError

# ---------------------------------------------------------------- writers of the real formats
from tests.support.data_files import (
    image_of,
    write_image_folder,
    write_leaf,
    write_medmnist,
    write_png_bomb,
    write_tiny_imagenet,
)


@pytest.mark.parametrize(("rgb", "size"), [(False, 28), (True, 64)])
def test_medmnist_pools_the_splits_as_uint8_nchw(tmp_path, rgb, size):
    subset = "pathmnist" if rgb else "organamnist"
    write_medmnist(tmp_path, subset, size=size, rgb=rgb)
    data = load_dataset("medmnist", root=tmp_path, download=False, subset=subset, size=size if size != 28 else None)
    channels = 3 if rgb else 1
    assert data.x.shape == (11, channels, size, size) and data.x.dtype == np.uint8
    assert data.y.dtype == np.int64 and data.y.tolist()[:8] == [0, 1, 2, 3, 0, 1, 0, 1]
    assert data.num_classes == (9 if rgb else 11)
    assert data.mean == (0.5,) * channels and data.std == (0.5,) * channels and data.groups is None
    npz = np.load(tmp_path / (f"{subset}.npz" if size == 28 else f"{subset}_{size}.npz"))
    first = npz["train_images"][0]
    assert np.array_equal(data.x[0], first.transpose(2, 0, 1) if rgb else first[None])


def test_medmnist_errors_name_the_field_and_allowed_values(tmp_path):
    with pytest.raises(DataError, match=r"dataset\.subset: 'nosuchmnist'.*allowed: pathmnist, octmnist"):
        load_dataset("medmnist", root=tmp_path, download=False, subset="nosuchmnist")
    with pytest.raises(DataError, match=r"dataset\.subset: dataset\.name=medmnist needs it; allowed: pathmnist"):
        load_dataset("medmnist", root=tmp_path, download=False)
    with pytest.raises(DataError, match=r"dataset\.subset: chestmnist is multi-label.*allowed:"):
        load_dataset("medmnist", root=tmp_path, download=False, subset="chestmnist")
    with pytest.raises(DataError, match=r"dataset\.size: MedMNIST publishes 28, 64, 128, 224 pixels, not 32"):
        load_dataset("medmnist", root=tmp_path, download=False, subset="bloodmnist", size=32)
    with pytest.raises(DataError, match=f"dataset.root: {tmp_path / 'bloodmnist_128.npz'}: no such file") as error:
        load_dataset("medmnist", root=tmp_path, download=False, subset="bloodmnist", size=128)
    assert "\n" not in str(error.value)
    write_medmnist(tmp_path, "breastmnist", classes=4)
    with pytest.raises(DataError, match=r"breastmnist\.npz: labels must lie in 0\.\.1"):
        load_dataset("medmnist", root=tmp_path, download=False, subset="breastmnist")


def test_medmnist_resource_table_covers_every_subset_and_size():
    for subset in medmnist_module.CLASSES:
        for size in medmnist_module.SIZES:
            url, md5 = medmnist_module.resource(subset, size)
            assert url.endswith(f"/{medmnist_module.file_name(subset, size)}?download=1") and len(md5) == 32


def test_image_folder_reads_classes_in_sorted_order(tmp_path):
    root = write_image_folder(tmp_path / "pets")
    data = load_dataset("image_folder", root=root)
    assert data.x.shape == (12, 1, 12, 12) and data.x.dtype == np.uint8
    assert data.y.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and data.num_classes == 3
    # ant (class 0) was written second, with values 40 + k; files sorted by path: ant1..ant3, nested/ant0
    assert np.abs(data.x[:4, 0, 0, 0].astype(int) - [41, 42, 43, 40]).max() <= 1
    assert len(data.mean) == 1 and abs(data.mean[0] - data.x.mean() / 255) < 1e-9
    assert abs(data.std[0] - (data.x / 255).std()) < 1e-9


def test_image_folder_uses_rgb_if_any_image_has_colour_and_resizes(tmp_path):
    root = write_image_folder(tmp_path / "pets", size=(10, 14), color=True)
    data = load_dataset("image_folder", root=root, size=8)
    assert data.x.shape == (12, 3, 8, 8) and len(data.mean) == 3 and len(data.std) == 3
    gray = data.x[1]  # ant1.jpg: grayscale, so the three channels are equal
    assert np.array_equal(gray[0], gray[1]) and np.array_equal(gray[1], gray[2])


def test_image_folder_channels_forces_grey_or_rgb(tmp_path):
    """`dataset.channels: 3` reads grey images as RGB, as the FLAME authors' ImageFolder reads Medical MNIST."""
    root = write_image_folder(tmp_path / "pets")
    grey = load_dataset("image_folder", root=root)
    rgb = load_dataset("image_folder", root=root, channels=3)
    assert rgb.x.shape == (12, 3, 12, 12) and all(np.array_equal(rgb.x[:, c], grey.x[:, 0]) for c in range(3))
    coloured = write_image_folder(tmp_path / "colour", color=True)
    assert load_dataset("image_folder", root=coloured, channels=1).x.shape[1] == 1


def test_image_folder_errors(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=f"dataset.root: {missing}: no such folder"):
        load_dataset("image_folder", root=missing)
    with pytest.raises(DataError, match=r"dataset\.root: dataset\.name=image_folder needs"):
        load_dataset("image_folder")
    root = write_image_folder(tmp_path / "pets")
    odd = root / "cat" / "odd.png"
    image_of(1, (13, 12), "L").save(odd)
    with pytest.raises(DataError, match=f"{re.escape(str(odd))}: 13x12 pixels, but .* is 12x12; set dataset.size"):
        load_dataset("image_folder", root=root)
    (root / "empty").mkdir()
    with pytest.raises(DataError, match=f"dataset.root: {root / 'empty'}: no image files"):
        load_dataset("image_folder", root=root)


@pytest.mark.parametrize("side", [20_000, 10_000], ids=["above-pillows-error-limit", "above-its-warning-limit"])
def test_a_decompression_bomb_is_refused_naming_the_file(tmp_path, side):
    root = write_image_folder(tmp_path / "pets")
    bomb = write_png_bomb(root / "bee" / "bomb.png", side)
    assert bomb.stat().st_size < 200_000
    with pytest.raises(
        DataError, match=f"{re.escape(str(bomb))}: not read: Image size \\({side * side} pixels\\) exceeds limit"
    ):
        load_dataset("image_folder", root=root)


def test_symbolic_link_loops_and_duplicates_are_refused_and_plain_links_followed(tmp_path):
    root = write_image_folder(tmp_path / "pets")
    (root / "all").symlink_to(root)  # a class folder that is the dataset root: every image again, as one class
    with pytest.raises(
        DataError,
        match=f"dataset.root: {root / 'all'} is a symbolic link loop: it leads back to "
        f"{root}; every image must be read once",
    ):
        load_dataset("image_folder", root=root)
    (root / "all").unlink()
    (root / "cat" / "nested" / "up").symlink_to(root / "cat")
    with pytest.raises(
        DataError, match=f"{root / 'cat' / 'nested' / 'up'} is a symbolic link loop: it leads back to {root / 'cat'}"
    ):
        load_dataset("image_folder", root=root)
    (root / "cat" / "nested" / "up").unlink()
    (root / "dog").symlink_to(root / "cat")
    with pytest.raises(DataError, match=r"is the same folder as"):
        load_dataset("image_folder", root=root)
    (root / "dog").unlink()
    (root / "ant" / "copy.png").symlink_to(root / "bee" / "bee2.png")
    with pytest.raises(DataError, match=f"{root / 'bee' / 'bee2.png'} is the same image file as {root / 'ant'}/copy"):
        load_dataset("image_folder", root=root)
    (root / "ant" / "copy.png").unlink()
    elsewhere = write_image_folder(tmp_path / "more")
    (root / "dog").symlink_to(elsewhere / "cat")  # a class kept elsewhere, and a folder of it linked in
    (root / "bee" / "extra").symlink_to(elsewhere / "bee")
    data = load_dataset("image_folder", root=root)
    assert data.num_classes == 4 and data.y.tolist() == [0] * 4 + [1] * 8 + [2] * 4 + [3] * 4


def test_medical_mnist_class_names_get_the_flame_constants(tmp_path):
    for k, name in enumerate(sorted(image_folder_module.MEDICAL_MNIST_CLASSES)):
        (tmp_path / name).mkdir()
        image_of(30 * k, (64, 64), "L").save(tmp_path / name / "000000.jpeg")
    data = load_dataset("image_folder", root=tmp_path)
    assert data.x.shape == (6, 1, 64, 64) and data.mean == (0.3,) and data.std == (0.3,)


def test_tiny_imagenet_pools_train_and_val_with_sorted_wnids(tmp_path):
    write_tiny_imagenet(tmp_path)
    data = load_dataset("tiny_imagenet", root=tmp_path, download=False)
    assert data.x.shape == (15, 3, 64, 64) and data.x.dtype == np.uint8 and data.num_classes == 3
    # sorted wnids: n01443537=0, n02124075=1, n03444034=2; train class by class, then val in file order
    assert data.y.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [2, 2, 0, 0, 1, 1]
    assert data.mean == image_folder_module.TINY_IMAGENET_MEAN and len(data.std) == 3
    same = load_dataset("tiny_imagenet", root=tmp_path / "tiny-imagenet-200", download=False, size=32)
    assert same.x.shape == (15, 3, 32, 32)


def test_tiny_imagenet_errors(tmp_path):
    with pytest.raises(DataError, match=f"dataset.root: {tmp_path / 'tiny-imagenet-200'}: no Tiny-ImageNet here"):
        load_dataset("tiny_imagenet", root=tmp_path, download=False)
    base = write_tiny_imagenet(tmp_path)
    annotations = base / "val" / "val_annotations.txt"
    annotations.write_text("val_0.JPEG\tn99999999\t0\t1\t2\t3\n")
    with pytest.raises(DataError, match=f"{annotations}:1: expected"):
        load_dataset("tiny_imagenet", root=tmp_path, download=False)
    annotations.unlink()
    with pytest.raises(DataError, match=f"dataset.root: {annotations}: no such file"):
        load_dataset("tiny_imagenet", root=tmp_path, download=False)


def test_femnist_groups_are_sorted_writers_across_train_and_test(tmp_path):
    writers = write_leaf(tmp_path)
    data = load_dataset("femnist", root=tmp_path)
    total = sum(writers.values())
    assert data.x.shape == (total, 1, 28, 28) and data.x.dtype == np.uint8 and data.num_classes == 62
    names = sorted(writers)  # f0001_12, f0420_07, f3100_45
    assert data.groups.tolist() == [g for g, name in enumerate(names) for _ in range(writers[name])]
    assert data.mean == (0.0,) and data.std == (1.0,)
    # the first sample of f0001_12 is its first train row, stored as round(255 v)
    content = json.loads((tmp_path / "train" / "all_data_0_niid_0_keep_0_train_9.json").read_text())
    row = np.asarray(content["user_data"]["f0001_12"]["x"][0])
    assert np.array_equal(data.x[0].reshape(-1), np.rint(row * 255).astype(np.uint8))
    assert data.y[0] == content["user_data"]["f0001_12"]["y"][0]


def test_femnist_digits_keeps_the_digit_samples_and_62_outputs(tmp_path):
    write_leaf(tmp_path, samples=40)
    everything = load_dataset("femnist", root=tmp_path)
    digits = load_dataset("femnist", root=tmp_path, split="digits")
    keep = everything.y < 10
    assert np.array_equal(digits.x, everything.x[keep]) and np.array_equal(digits.y, everything.y[keep])
    assert digits.num_classes == 62 and digits.groups.max() + 1 == len(np.unique(everything.groups[keep]))
    with pytest.raises(ConfigError, match=r"dataset.split: must be 'all' or 'digits' \(got 'letters'\)"):
        load_dataset("femnist", root=tmp_path, split="letters")


def test_femnist_reads_all_data_and_explains_how_to_get_it(tmp_path):
    with pytest.raises(DataError, match=f"dataset.root: {tmp_path}: no LEAF FEMNIST JSON.*preprocess.sh"):
        load_dataset("femnist", root=tmp_path)
    with pytest.raises(DataError, match=f"dataset.root: {tmp_path / 'gone'}: no such folder.*preprocess.sh"):
        load_dataset("femnist", root=tmp_path / "gone")
    write_leaf(tmp_path / "data" / "staging")
    (tmp_path / "data" / "staging" / "train").rename(tmp_path / "data" / "all_data")
    data = load_dataset("femnist", root=tmp_path)
    assert len(np.unique(data.groups)) == 3
    bad = tmp_path / "data" / "all_data" / "broken.json"
    bad.write_text(json.dumps({"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[2.0] * 784], "y": [1]}}}))
    with pytest.raises(DataError, match=f"{bad}: writer u: pixel values must lie in"):
        load_dataset("femnist", root=tmp_path)
