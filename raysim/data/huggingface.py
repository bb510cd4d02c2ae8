"""Any Hugging Face dataset (`dataset.name: huggingface`), read with the `datasets` library.

`dataset.path` is a folder written by `save_to_disk` (a Dataset or a DatasetDict, read with `load_from_disk`,
works offline) or anything `datasets.load_dataset` takes: a hub name (online; `dataset.subset` is its config
name, `dataset.root` its cache folder) or a local folder of csv/parquet/image files.

Splits: `dataset.split` picks one split of a DatasetDict. Unset, all splits are pooled into one dataset (the
simulator partitions and holds out test data itself), in the order flwr-datasets users expect: "train", then
"test", then the others by name.

Columns: `dataset.image` holds PIL images (decoded into uint8 (n, C, H, W): C = 3 if any image has colour,
else 1; all of one size unless `dataset.size` resizes each to size x size) or numbers / lists / arrays of
numbers (float32 features (n, ...)). `dataset.label` holds ClassLabel values (the number of classes is the
feature's) or non-negative integers (max + 1 classes). uint8 images carry per-channel `mean`/`std` computed
from the loaded data in [0, 1] units (what the trainers normalize with on the fly); features carry none.

`datasets` is imported only here, when this source is used: it takes seconds to import.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.data.dataset import DATASETS, Dataset, RootSettings
from raysim.data.image_folder import GRAY_MODES, channel_stats
from raysim.errors import DataError

if TYPE_CHECKING:
    import datasets
    import PIL.Image

SPLIT_ORDER = {"train": 0, "test": 1}
"""Pooling order of a DatasetDict's splits: train, test, then the rest by name (flwr-datasets' habit)."""

_BATCH = 1024


@DATASETS.register()
class HuggingfaceSettings(RootSettings):
    name: Literal["huggingface"] = "huggingface"
    root: str | None = Field(None, description="cache folder of hub downloads (default: the datasets library's)")
    path: str | None = Field(None, description="a saved dataset's folder (save_to_disk), or a hub name")
    split: str | None = Field(None, description="the split to load (default: all splits pooled)")
    subset: str | None = Field(None, description="the hub config name")
    image: str = Field("image", description="the column holding the image or feature vector")
    label: str = Field("label", description="the column holding the class label")
    size: int | None = Field(None, ge=1, description="resize images to size x size")
    about: ClassVar[str] = "any Hugging Face dataset (`dataset.path`, `split`, `image`, `label` columns)"
    layout: ClassVar[str] = "a folder written by `save_to_disk` (dataset.path), or a hub name online"
    get: ClassVar[str] = "`datasets.load_dataset(...).save_to_disk(folder)` on a machine online"

    def load(self, seed: int) -> Dataset:
        return huggingface(self)


def huggingface(request: HuggingfaceSettings) -> Dataset:
    """The rows of `dataset.path` (one split or all pooled) as images or features plus class labels."""
    if request.path is None:
        raise DataError(
            "dataset.path: dataset.name=huggingface needs a folder written by save_to_disk or a hub dataset name"
        )
    source = str(request.path)
    table = _select(_open(source, request), request.split, source)
    columns = table.column_names
    for field, column in (("image", request.image), ("label", request.label)):
        if column not in columns:
            raise DataError(
                f"dataset.{field}: {source} has no column {column!r}; its columns: {', '.join(columns) or 'none'}"
            )
    if len(table) == 0:
        raise DataError(f"dataset.split: {source} has no rows")
    labels, num_classes = _labels(table, request.label, source)
    name = Path(source).name or source
    if _is_image(table.features[request.image]):
        x = _images(table, request.image, request.size, source)
        mean, std = channel_stats(x)
        return Dataset(name, x, labels, num_classes, mean=mean, std=std)
    return Dataset(name, _features(table, request.image, source), labels, num_classes)


def _is_saved_folder(folder: Path) -> bool:
    """Whether `folder` was written by save_to_disk (a DatasetDict's or a Dataset's marker file)."""
    return folder.is_dir() and ((folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file())


def _open(source: str, request: HuggingfaceSettings) -> datasets.Dataset | datasets.DatasetDict:
    """load_from_disk for a saved folder, else load_dataset (hub name or local data files)."""
    import datasets

    folder = Path(source).expanduser()
    if _is_saved_folder(folder):
        try:
            return datasets.load_from_disk(str(folder))
        except (OSError, ValueError) as error:
            raise DataError(f"dataset.path: {folder}: not a readable saved dataset ({_first_line(error)})") from None
    cache = str(Path(request.root).expanduser()) if request.root is not None else None
    try:
        loaded = datasets.load_dataset(source, request.subset, cache_dir=cache)
    except OSError as error:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, offline mode
        raise DataError(
            f"dataset.path: {source!r} is neither a folder written by save_to_disk nor reachable on the Hugging "
            f"Face hub ({_first_line(error)})"
        ) from None
    except Exception as error:  # datasets raises many types (missing config name, unreadable files, ...)
        raise DataError(f"dataset.path: datasets.load_dataset({source!r}) failed: {_first_line(error)}") from None
    if not isinstance(loaded, datasets.Dataset | datasets.DatasetDict):
        raise DataError(f"dataset.path: {source!r} loads as {type(loaded).__name__}, not a Dataset or DatasetDict")
    return loaded


def _select(loaded: datasets.Dataset | datasets.DatasetDict, split: str | None, source: str) -> datasets.Dataset:
    """The requested split, or all splits pooled in SPLIT_ORDER."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        own = None if loaded.split is None else str(loaded.split)
        if split is not None and split != own:
            raise DataError(
                f"dataset.split: {source} holds one dataset (split {own or 'unnamed'}), not splits to choose "
                f"from; leave dataset.split unset"
            )
        return loaded
    names = sorted(loaded, key=lambda name: (SPLIT_ORDER.get(name, len(SPLIT_ORDER)), name))
    if split is not None:
        if split not in loaded:
            raise DataError(f"dataset.split: {source} has no split {split!r}; its splits: {', '.join(names)}")
        return loaded[split]
    if not names:
        raise DataError(f"dataset.path: {source} holds no splits")
    if len(names) == 1:
        return loaded[names[0]]
    try:
        return datasets.concatenate_datasets([loaded[name] for name in names])
    except ValueError as error:
        raise DataError(
            f"dataset.split: the splits of {source} ({', '.join(names)}) cannot be pooled "
            f"({_first_line(error)}); choose one with dataset.split"
        ) from None


def _labels(table: datasets.Dataset, column: str, source: str) -> tuple[np.ndarray, int]:
    """int64 labels and the number of classes (a ClassLabel's own count, else max + 1)."""
    import datasets

    feature = table.features[column]
    values = _column(table, column)
    if values.ndim != 1 or not (np.issubdtype(values.dtype, np.integer) or values.dtype == bool):
        raise DataError(
            f"dataset.label: column {column!r} of {source} must hold one integer class per row, got "
            f"{feature} ({values.dtype}, shape {values.shape})"
        )
    labels = values.astype(np.int64)
    if labels.min() < 0:
        raise DataError(
            f"dataset.label: column {column!r} of {source} has label {int(labels.min())} (unlabeled rows?); "
            f"choose a labeled split with dataset.split"
        )
    if isinstance(feature, datasets.ClassLabel):
        if labels.max() >= feature.num_classes:
            raise DataError(
                f"dataset.label: column {column!r} of {source} has label {int(labels.max())}, but its ClassLabel "
                f"has {feature.num_classes} classes"
            )
        return labels, int(feature.num_classes)
    return labels, int(labels.max()) + 1


def _is_image(feature: Any) -> bool:
    import datasets

    return isinstance(feature, datasets.Image)


def _column(table: datasets.Dataset, column: str) -> np.ndarray:
    """One non-image column as a numpy array (object dtype when its rows have different shapes)."""
    values = table.select_columns([column]).with_format("numpy")[:][column]
    return values if isinstance(values, np.ndarray) else np.asarray(values, dtype=object)


def _features(table: datasets.Dataset, column: str, source: str) -> np.ndarray:
    """A numeric column as float32 features (n, ...); a scalar per row becomes (n, 1)."""
    values = _column(table, column)
    if values.dtype == object:
        raise DataError(
            f"dataset.image: column {column!r} of {source} ({table.features[column]}) is neither images nor "
            f"numeric arrays of one shape per row"
        )
    if not (np.issubdtype(values.dtype, np.number) or values.dtype == bool):
        raise DataError(
            f"dataset.image: column {column!r} of {source} holds {values.dtype} values, not images or numbers"
        )
    x = values.astype(np.float32).reshape(len(values), -1) if values.ndim == 1 else values.astype(np.float32)
    if not np.isfinite(x).all():
        raise DataError(f"dataset.image: column {column!r} of {source} holds non-finite numbers")
    return np.ascontiguousarray(x)


def _encoded(table: datasets.Dataset, column: str) -> Iterator[dict | None]:
    """The stored (bytes, path) of every image, without decoding: batches of pyarrow structs."""
    for batch in table.select_columns([column]).with_format("arrow").iter(batch_size=_BATCH):
        yield from batch.column(column).to_pylist()


def _open_image(item: dict | None, row: int, column: str, source: str) -> PIL.Image.Image:
    from PIL import Image, UnidentifiedImageError

    if item is None or (item.get("bytes") is None and item.get("path") is None):
        raise DataError(f"dataset.image: column {column!r} of {source} has no image in row {row}")
    try:
        return Image.open(io.BytesIO(item["bytes"]) if item.get("bytes") is not None else item["path"])
    except (OSError, UnidentifiedImageError) as error:
        raise DataError(
            f"dataset.image: column {column!r} of {source}, row {row}: not a readable image ({error})"
        ) from None


def _images(table: datasets.Dataset, column: str, size: int | None, source: str) -> np.ndarray:
    """Decode the image column into uint8 (n, C, H, W) in two passes: headers first (colour and sizes, cheap),
    then pixels into one preallocated array, so memory is the decoded dataset once."""
    from PIL import Image

    colour, sizes = False, set()
    for row, item in enumerate(_encoded(table, column)):
        with _open_image(item, row, column, source) as image:
            colour = colour or image.mode not in GRAY_MODES
            sizes.add(image.size)
    if size is None and len(sizes) > 1:
        examples = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:3])
        raise DataError(
            f"dataset.image: column {column!r} of {source} holds images of {len(sizes)} sizes ({examples}, ...); "
            f"set dataset.size to resize them all to size x size"
        )
    width, height = (size, size) if size is not None else next(iter(sizes))
    mode, channels = ("RGB", 3) if colour else ("L", 1)
    out = np.empty((len(table), channels, height, width), dtype=np.uint8)
    for row, item in enumerate(_encoded(table, column)):
        with _open_image(item, row, column, source) as image:
            picture = image.convert(mode)
        if picture.size != (width, height):
            picture = picture.resize((width, height), Image.Resampling.BILINEAR)
        pixels = np.asarray(picture, dtype=np.uint8)
        out[row] = pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
    return out


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
