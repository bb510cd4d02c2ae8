"""Small files in each dataset's published format (IDX, CIFAR pickles, EMNIST zips, LEAF, MedMNIST, Tiny-ImageNet,
TFF's FEMNIST, image folders, npz, Hugging Face `save_to_disk`), and the package's built-in sources."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raysim.data import DATASETS
from raysim.data.tff_emnist import FILES

MNIST_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file exactly as the publishers write it: 0, 0, type code, ndim, big-endian dims, then data."""
    code = {np.uint8: 0x08, np.int32: 0x0C}[array.dtype.type]
    header = bytes([0, 0, code, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(array)
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def write_emnist(directory: Path, split: str, upright: dict[str, np.ndarray], gz: bool = False) -> list[Path]:
    """EMNIST stores each image transposed: write the transpose of the upright images."""
    written = []
    for part in ("train", "test"):
        stored = upright[f"{part}_x"].transpose(0, 2, 1)
        written.append(write_idx(directory / f"emnist-{split}-{part}-images-idx3-ubyte", stored, gz))
        written.append(write_idx(directory / f"emnist-{split}-{part}-labels-idx1-ubyte", upright[f"{part}_y"], gz))
    return written


def cifar_batch(n: int, labels_key: bytes, classes: int, rng: np.random.Generator) -> dict[bytes, object]:
    """One batch as the publisher's files hold it: b'data' uint8 (n, 3072) rows (R, G, B planes), label list."""
    batch: dict[bytes, object] = {
        b"batch_label": b"a test batch",
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        labels_key: [int(v) for v in rng.integers(0, classes, size=n)],
        b"filenames": [f"img_{k}.png".encode() for k in range(n)],
    }
    if labels_key == b"fine_labels":
        batch[b"coarse_labels"] = [int(v) % 20 for v in batch[labels_key]]
    return batch


def write_cifar100(root: Path, seed: int = 0) -> list[dict[bytes, object]]:
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    batches = []
    for name, n in (("train", 7), ("test", 3)):
        batch = cifar_batch(n, b"fine_labels", 100, rng)
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        batches.append(batch)
    return batches


def write_medmnist(folder: Path, subset: str, size: int = 28, rgb: bool = False, classes: int = 4) -> Path:
    """A MedMNIST-style .npz: {train,val,test}_{images,labels}, images (n, H, W[, 3]) uint8, labels (n, 1)."""
    generator = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 6), ("val", 2), ("test", 3)):
        shape = (n, size, size, 3) if rgb else (n, size, size)
        arrays[f"{split}_images"] = generator.integers(0, 256, size=shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % classes).reshape(n, 1).astype(np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"{subset}.npz" if size == 28 else f"{subset}_{size}.npz")
    np.savez_compressed(path, **arrays)
    return path


def image_of(value: int, size: tuple[int, int], mode: str) -> Image.Image:
    fill = value if mode == "L" else (value, 255 - value, value // 2)
    return Image.new(mode, size, fill)


def write_tiny_imagenet(root: Path, per_class: int = 3, val_per_class: int = 2) -> Path:
    """Tiny-ImageNet-200's layout with three wnids (listed unsorted), one grayscale JPEG among them."""
    base = root / "tiny-imagenet-200"
    wnids = ["n03444034", "n01443537", "n02124075"]
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    lines = []
    for wnid in wnids:
        images = base / "train" / wnid / "images"
        images.mkdir(parents=True)
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
        for k in range(per_class):
            image_of(10 * k, (64, 64), "L" if k == 0 else "RGB").save(images / f"{wnid}_{k}.JPEG")
        for _ in range(val_per_class):
            name = f"val_{len(lines)}.JPEG"
            image_of(200, (64, 64), "RGB").save(base / "val" / "images" / name)
            lines.append(f"{name}\t{wnid}\t0\t1\t62\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return base


def write_leaf(root: Path, samples: int = 5) -> dict[str, int]:
    """LEAF FEMNIST JSON for three writers split over train/ and test/ (two files per split); returns each
    writer's total sample count."""
    generator = np.random.default_rng(1)
    writers = {"f3100_45": samples + 2, "f0001_12": samples, "f0420_07": samples + 4}
    for split in ("train", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for part, names in enumerate((["f3100_45", "f0001_12"], ["f0420_07"])):
            user_data, counts = {}, []
            for name in names:
                held_out = writers[name] // 4
                n = held_out if split == "test" else writers[name] - held_out
                x = np.round(generator.random((n, 784)) * 255) / 255
                y = generator.integers(0, 62, size=n)
                user_data[name] = {"x": x.tolist(), "y": y.tolist()}
                counts.append(n)
            content = {"users": names, "num_samples": counts, "user_data": user_data}
            (root / split / f"all_data_{part}_niid_0_keep_0_{split}_9.json").write_text(json.dumps(content))
    return writers


WRITERS = {"f3100_45": (9, 2), "f0001_12": (6, 1), "f0420_07": (7, 3), "f1998_30": (5, 2), "f0002_03": (4, 1)}
"""Writer id -> (train samples, test samples); TFF's ids are not stored sorted by this dict's order."""


def write_tff_emnist(root: Path, split: str = "digits", writers: dict[str, tuple[int, int]] = WRITERS) -> dict:
    """TFF's two files of `split` under `root`: each writer's pixels (float32 [n, 28, 28] in [0, 1], multiples of
    1/255) and labels (int32; 0-9 for digits, 0-61 otherwise). Returns writer -> (train x, train y, test x, test y)."""
    generator = np.random.default_rng(3)
    classes = 10 if split == "digits" else 62
    written: dict[str, list[np.ndarray]] = {writer: [] for writer in writers}
    root.mkdir(parents=True, exist_ok=True)
    for part, name in enumerate(FILES[split]):
        with h5py.File(root / name, "w") as handle:
            examples = handle.create_group("examples")
            for writer, counts in writers.items():
                n = counts[part]
                pixels = (generator.integers(0, 256, size=(n, 28, 28)) / 255.0).astype(np.float32)
                labels = generator.integers(0, classes, size=n).astype(np.int32)
                examples.create_dataset(f"{writer}/pixels", data=pixels)
                examples.create_dataset(f"{writer}/label", data=labels)
                written[writer] += [pixels, labels]
    return written


def write_npz(path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


def mnist_arrays(seed: int = 0, classes: int = 10, low: int = 0) -> dict[str, np.ndarray]:
    """Train (6) and test (4) images and labels, distinct per sample."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for part, n in (("train", 6), ("test", 4)):
        arrays[f"{part}_x"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        arrays[f"{part}_y"] = rng.integers(low, low + classes, size=n).astype(np.uint8)
    return arrays


def write_mnist(directory: Path, arrays: dict[str, np.ndarray], gz: bool = False) -> list[Path]:
    keys = ("train_x", "train_y", "test_x", "test_y")
    return [write_idx(directory / stem, arrays[key], gz) for stem, key in zip(MNIST_STEMS, keys, strict=True)]


def write_cifar10(root: Path, per_batch: int = 4, seed: int = 0) -> list[dict[bytes, object]]:
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    batches = []
    for name in (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"):
        batch = cifar_batch(per_batch, b"labels", 10, rng)
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        batches.append(batch)
    return batches


def write_image_folder(root: Path, per_class: int = 4, size: tuple[int, int] = (12, 12), color: bool = False) -> Path:
    """Three class folders (created out of order) of PNGs and JPEGs, one inside a nested folder."""
    for label, name in enumerate(("cat", "ant", "bee")):  # sorted: ant=0, bee=1, cat=2
        folder = root / name
        (folder / "nested").mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            mode = "RGB" if color and k == 0 else "L"
            target = folder / ("nested" if k == 0 else ".") / f"{name}{k}.{'jpg' if k % 2 else 'png'}"
            image_of(40 * label + k, size, mode).save(target)
    return root


def write_png_bomb(path: Path, side: int = 20_000) -> Path:
    """A valid 1-bit PNG of side x side pixels (400 M at the default) that is about 50 KB on disk: its rows are
    zeros, which deflate packs about 1000:1."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer = zlib.compressobj(9)
    row = bytes(1 + (side + 7) // 8)  # filter byte 0, then the packed pixels
    body = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1 bit, grayscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b""))
    return path


datasets = pytest.importorskip("datasets")


def tabular_dataset(n: int = 200, seed: int = 0):
    """Three Gaussian clusters in 10 dimensions as a list-of-floats column plus plain int labels."""
    generator = np.random.default_rng(seed)
    centres = generator.normal(0.0, 3.0, size=(3, 10))
    labels = generator.integers(0, 3, size=n)
    rows = centres[labels] + generator.normal(size=(n, 10))
    features = datasets.Features(
        {"features": datasets.List(datasets.Value("float32")), "target": datasets.Value("int64")}
    )
    return datasets.Dataset.from_dict({"features": rows.tolist(), "target": labels.tolist()}, features=features)


def save_dataset(table, folder: Path) -> str:
    table.save_to_disk(str(folder))
    return str(folder)


BUILT_IN = {name: source for name, source in DATASETS.items() if source.__module__.startswith("raysim.")}
"""The package's own sources (a plugin's, registered in this process by another test, is in neither the README nor
a fresh `raysim datasets`)."""


SMALL_CRISIS = {"name": "crisismmd_synthetic", "samples": 120, "image_dim": 24, "text_dim": 8, "tokens": 6}
"""A CrisisMMD-shaped substitute small enough to train in milliseconds (the models read their sizes from it)."""


def write_partition_table(path: Path, columns: dict, metadata: dict | None = None) -> Path:
    table = pa.table(columns)
    if metadata is not None:
        table = table.replace_schema_metadata({b"raysim": json.dumps(metadata).encode()})
    pq.write_table(table, path)
    return path
