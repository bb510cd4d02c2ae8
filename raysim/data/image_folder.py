"""Image datasets stored as image files: torchvision's ImageFolder layout, and Tiny-ImageNet-200.

Images are decoded with Pillow into one preallocated uint8 array (n, C, H, W), so memory is the size of
the dataset once, and normalized on the fly by the trainers with the Dataset's `mean`/`std`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.data.dataset import DATASETS, Dataset, DownloadSettings, RootSettings
from raysim.data.download import extract, fetch, resolve_root
from raysim.data.footprint import LABEL_BYTES, Footprint, image_rows
from raysim.errors import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""The file types torchvision's ImageFolder reads (its IMG_EXTENSIONS)."""

GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"})
"""Pillow modes without colour; anything else (RGB, RGBA, P, CMYK, ...) counts as colour."""

MEDICAL_MNIST_CLASSES = frozenset({"AbdomenCT", "BreastMRI", "CXR", "ChestCT", "Hand", "HeadCT"})
MEDICAL_MNIST_MEAN_STD = 0.3
"""The FLAME authors' Normalize(0.3, 0.3) for Kaggle's Medical MNIST (FLAME, Table II)."""

TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_IMAGENET_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
"""The md5 that many public Tiny-ImageNet loaders pin for the cs231n zip (about 248 MB); not checked from
here (offline), so a mismatch on a real download would need a second look, not a silent override."""
TINY_IMAGENET_MEAN = (0.4802, 0.4481, 0.3975)
TINY_IMAGENET_STD = (0.2302, 0.2265, 0.2262)
"""Per-channel statistics of Tiny-ImageNet's training images, the values commonly used for it."""

_STATS_CHUNK = 4096


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    """Pillow's errors on `path` as one DataError naming it: an unreadable file, and an image above Pillow's
    decompression-bomb limit (Image.MAX_IMAGE_PIXELS, 89 M pixels: a few KB of PNG can claim gigabytes once
    decoded), which Pillow only warns about up to twice the limit and which is refused here from the limit on."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise DataError(f"{path}: not read: {error}") from None
    except (OSError, UnidentifiedImageError) as error:
        raise DataError(f"{path}: not a readable image ({error})") from None


def _channels(paths: Sequence[Path]) -> str:
    """'RGB' if any image has colour, else 'L' (only the headers are read)."""
    from PIL import Image

    for path in paths:
        with _readable(path), Image.open(path) as image:
            if image.mode not in GRAY_MODES:
                return "RGB"
    return "L"


def read_images(paths: Sequence[Path], size: int | None = None, mode: str | None = None) -> np.ndarray:
    """Decode `paths` into uint8 (n, C, H, W): converted to `mode` ('L' or 'RGB'; None: RGB if any image has
    colour, else L), resized to size x size when `size` is given, else all must share the first one's size."""
    from PIL import Image

    if not paths:
        raise DataError("no images to read")
    mode = mode or _channels(paths)
    channels = 3 if mode == "RGB" else 1
    out: np.ndarray | None = None
    for index, path in enumerate(paths):
        with _readable(path), Image.open(path) as image:
            picture = image.convert(mode)
        if size is not None and picture.size != (size, size):
            picture = picture.resize((size, size), Image.Resampling.BILINEAR)
        if out is None:
            width, height = picture.size
            out = np.empty((len(paths), channels, height, width), dtype=np.uint8)
        elif picture.size != (out.shape[3], out.shape[2]):
            raise DataError(
                f"{path}: {picture.size[0]}x{picture.size[1]} pixels, but {paths[0]} is "
                f"{out.shape[3]}x{out.shape[2]}; set dataset.size to resize all images to one size"
            )
        pixels = np.asarray(picture, dtype=np.uint8)
        out[index] = pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
    assert out is not None
    return out


def channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (n, C, H, W) in [0, 1] units, in chunks (no float copy of the
    whole dataset); a constant channel gets std 1 so that normalizing never divides by zero."""
    total = np.zeros(x.shape[1])
    squares = np.zeros(x.shape[1])
    for start in range(0, len(x), _STATS_CHUNK):
        chunk = x[start : start + _STATS_CHUNK].astype(np.float64) / 255.0
        total += chunk.sum(axis=(0, 2, 3))
        squares += np.square(chunk).sum(axis=(0, 2, 3))
    count = len(x) * x.shape[2] * x.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0.0))
    std[std < 1e-6] = 1.0
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def _text(file: Path) -> str:
    """A Tiny-ImageNet list file's text; one DataError line naming it when it is not UTF-8 (a damaged file)."""
    try:
        return file.read_text()
    except UnicodeDecodeError as error:
        raise DataError(f"dataset.root: {file}: not UTF-8 text (at byte {error.start})") from None


def _class_images(root: Path, classes: list[str]) -> list[list[Path]]:
    """Each class folder's image files (recursively, sorted, hidden entries skipped). Links to folders are
    followed; refused with one line: a link back to a folder above it (the dataset root itself included: a loop,
    whose images would come back as a class of duplicates) and two paths to one folder or image file (the same
    images in two places, or in two classes)."""
    folders: dict[str, Path] = {os.path.realpath(root): root}
    """Every folder read so far (its real path: the path it was reached by)."""
    images: dict[str, Path] = {}
    per_class = []
    for name in classes:
        found: list[Path] = []
        pending = [root / name]
        while pending:
            folder = pending.pop()
            real = os.path.realpath(folder)
            if real in folders:
                parent = os.path.realpath(folder.parent)
                loop = parent == real or parent.startswith(real.rstrip(os.sep) + os.sep)  # back to itself or above
                what = "a symbolic link loop: it leads back to" if loop else "the same folder as"
                raise DataError(f"dataset.root: {folder} is {what} {folders[real]}; every image must be read once")
            folders[real] = folder
            for entry in os.scandir(folder):
                path = folder / entry.name
                if entry.name.startswith("."):
                    continue
                try:
                    is_folder = entry.is_dir()
                except OSError as error:  # ELOOP: links that lead to each other (is_dir swallows only ENOENT)
                    raise DataError(f"dataset.root: {path}: cannot be followed ({error.strerror})") from None
                if is_folder:
                    pending.append(path)
                elif entry.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
                    file = os.path.realpath(path)
                    if file in images:
                        raise DataError(
                            f"dataset.root: {path} is the same image file as {images[file]}; every "
                            "image must be read once"
                        )
                    images[file] = path
                    found.append(path)
        per_class.append(sorted(found))
    return per_class


@DATASETS.register()
class ImageFolderSettings(RootSettings):
    name: Literal["image_folder"] = "image_folder"
    size: int | None = Field(None, ge=1, description="resize images to size x size (e.g. 64 for Medical MNIST)")
    channels: Literal[1, 3] | None = Field(
        None,
        description="convert every image to 1 (grey) or 3 (RGB) channels; default: RGB if any image has colour "
        "(the FLAME authors read Medical MNIST as RGB)",
    )
    about: ClassVar[str] = "any ImageFolder tree, e.g. Kaggle's Medical MNIST (FLAME's MMNIST, `dataset.size: 64`)"
    layout: ClassVar[str] = "one folder per class holding the images"
    get: ClassVar[str] = "your own files; Medical MNIST: kaggle.com/datasets/andrewmvd/medical-mnist"
    markers: ClassVar[tuple[str, ...]] = ("*/*.png", "*/*.jpg", "*/*.jpeg", "*/*.JPEG")

    def footprint(self) -> Footprint | None:
        return image_folder_footprint(self)

    def load(self, seed: int) -> Dataset:
        return image_folder(self)


@DATASETS.register()
class TinyImagenetSettings(DownloadSettings):
    name: Literal["tiny_imagenet"] = "tiny_imagenet"
    size: int | None = Field(None, ge=1, description="resize images to size x size (default: 64)")
    about: ClassVar[str] = "Tiny-ImageNet-200: 64x64 colour, 200 classes (FedSLR)"
    layout: ClassVar[str] = "tiny-imagenet-200/ (train/<wnid>/images, val/val_annotations.txt, wnids.txt)"
    get: ClassVar[str] = "`dataset.download: true` online (cs231n.stanford.edu)"
    markers: ClassVar[tuple[str, ...]] = ("tiny-imagenet-200/wnids.txt",)

    def footprint(self) -> Footprint:
        """100,000 training and 10,000 labelled validation images, decoded into one preallocated array."""
        size = self.size or 64
        return image_rows(110_000, (3, size, size), peak_factor=1.1)

    def load(self, seed: int) -> Dataset:
        return tiny_imagenet(self)


def image_folder(request: ImageFolderSettings) -> Dataset:
    """torchvision's ImageFolder layout: `dataset.root/<class>/.../<image>`, class index = position of the
    class folder in sorted order; images in any sub-folder of a class folder count.

    All images are converted to one mode: `dataset.channels` (1: grey, 3: RGB), by default RGB if any image has
    colour, else grayscale (L). Without
    `dataset.size` all images must have one size; with it, each is resized (bilinear) to size x size.
    Normalization constants: the FLAME authors' 0.3/0.3 when the classes are exactly Kaggle's Medical MNIST
    ones (AbdomenCT, BreastMRI, CXR, ChestCT, Hand, HeadCT: 58,954 grayscale 64x64 JPEGs; FLAME's Table II implies
    the 64x64 input from the CNN's 3136-wide flatten, and the authors' ImageFolder loads them as 3-channel
    RGB: `dataset.channels: 3`, which gives CNN1 Table II's 206,678 parameters), else each channel's mean and std
    measured on the loaded images."""
    if request.root is None:
        raise DataError("dataset.root: dataset.name=image_folder needs the folder holding one sub-folder per class")
    root = Path(request.root).expanduser()
    if not root.is_dir():
        raise DataError(f"dataset.root: {root}: no such folder (expected one sub-folder of images per class)")
    classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir() and not entry.name.startswith("."))
    if not classes:
        raise DataError(f"dataset.root: {root}: no class sub-folders (expected <root>/<class>/<image files>)")
    paths: list[Path] = []
    labels: list[int] = []
    for label, (name, files) in enumerate(zip(classes, _class_images(root, classes), strict=True)):
        if not files:
            raise DataError(f"dataset.root: {root / name}: no image files ({', '.join(IMAGE_SUFFIXES)})")
        paths += files
        labels += [label] * len(files)
    x = read_images(paths, request.size, mode={1: "L", 3: "RGB"}.get(request.channels or 0))
    if set(classes) == MEDICAL_MNIST_CLASSES:
        mean, std = (MEDICAL_MNIST_MEAN_STD,) * x.shape[1], (MEDICAL_MNIST_MEAN_STD,) * x.shape[1]
    else:
        mean, std = channel_stats(x)
    return Dataset(root.name, x, np.asarray(labels, dtype=np.int64), len(classes), mean=mean, std=std)


def image_folder_footprint(request: ImageFolderSettings) -> Footprint | None:
    """The image files under the class folders counted (not opened) and the first one's header read: one uint8
    array of them all at `dataset.size` (else the first image's size) in `dataset.channels` (else the first image's),
    plus at the peak the float64 chunk that `channel_stats` measures and a path per image. None without a root."""
    from PIL import Image

    root = Path(request.root).expanduser() if request.root else None
    if root is None or not root.is_dir():
        return None
    files = [
        Path(folder) / name
        for folder, _, names in os.walk(root)
        if Path(folder) != root
        for name in names
        if not name.startswith(".") and Path(name).suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        return None
    try:
        with Image.open(files[0]) as first:
            width, height, grey = first.size[0], first.size[1], first.mode in GRAY_MODES
    except OSError:
        return None  # load says what is wrong with it
    channels = request.channels or (1 if grey else 3)
    pixels = channels * (request.size or height) * (request.size or width)
    nbytes = len(files) * (pixels + LABEL_BYTES)
    return Footprint(len(files), nbytes, nbytes + min(len(files), _STATS_CHUNK) * pixels * 16 + len(files) * 200)


def _tiny_imagenet_dir(request: TinyImagenetSettings) -> Path:
    """The `tiny-imagenet-200` folder: `dataset.root` itself or its child, downloaded there if allowed."""
    root = resolve_root(request.root)
    for candidate in (root / "tiny-imagenet-200", root):
        if (candidate / "wnids.txt").is_file():
            return candidate
    base = root / "tiny-imagenet-200"
    if not request.download:
        raise DataError(
            f"dataset.root: {base}: no Tiny-ImageNet here (expected wnids.txt, train/ and val/; dataset.download "
            f"is off; the zip is at {TINY_IMAGENET_URL})"
        )
    archive = fetch(TINY_IMAGENET_URL, root / "tiny-imagenet-200.zip", TINY_IMAGENET_MD5)
    extract(archive, root)
    if not (base / "wnids.txt").is_file():
        raise DataError(f"{archive}: extracted, but {base / 'wnids.txt'} is missing (not the Tiny-ImageNet zip?)")
    return base


def _tiny_imagenet_files(base: Path) -> tuple[list[str], list[Path], list[int]]:
    """(sorted wnids, image paths, labels) of train + val."""
    wnids = sorted({line.strip() for line in _text(base / "wnids.txt").splitlines() if line.strip()})
    index = {wnid: label for label, wnid in enumerate(wnids)}
    paths: list[Path] = []
    labels: list[int] = []
    for wnid in wnids:
        folder = base / "train" / wnid / "images"
        files = sorted(p for p in folder.glob("*") if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
        if not files:
            raise DataError(f"dataset.root: {folder}: no training images for class {wnid} listed in wnids.txt")
        paths += files
        labels += [index[wnid]] * len(files)
    annotations = base / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise DataError(f"dataset.root: {annotations}: no such file (Tiny-ImageNet's validation labels)")
    for number, line in enumerate(_text(annotations).splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise DataError(f"{annotations}:{number}: expected '<file>\\t<wnid from wnids.txt>\\t...', got {line!r}")
        paths.append(base / "val" / "images" / fields[0])
        labels.append(index[fields[1]])
    return wnids, paths, labels


def tiny_imagenet(request: TinyImagenetSettings) -> Dataset:
    """Tiny-ImageNet-200: 200 classes of 64x64 RGB images (class index = sorted wnid), train (500 per class)
    and val (50 per class, labelled in val/val_annotations.txt) pooled: 110,000 images. The unlabelled test
    folder is not used. Grayscale JPEGs among them are converted to RGB; `dataset.size` resizes."""
    base = _tiny_imagenet_dir(request)
    wnids, paths, labels = _tiny_imagenet_files(base)
    x = read_images(paths, request.size, mode="RGB")
    validation = base / "val" / "images"
    return Dataset(
        "tiny_imagenet",
        x,
        np.asarray(labels, dtype=np.int64),
        len(wnids),
        mean=TINY_IMAGENET_MEAN,
        std=TINY_IMAGENET_STD,
        test_start=sum(path.parent != validation for path in paths),  # train first, then the labelled val images
    )
