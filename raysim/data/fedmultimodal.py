"""The real CrisisMMD, KU-HAR and Crema-D features as FedMultimodal-style pipelines write them (FedAPM's
`data/generate_data` scripts, FedAPM, Table 2, App. B.1), converted once into a safe archive that `dataset.name`
crisismmd, kuhar or cremad loads.

The authors' feature scripts pickle, per client, a list of samples `[key, path, label, features]` (the label is
the item before last, the features the last), one file per modality, paired by position:

- crisismmd: image [1,1280] in feature/img/mobilenet_v2/crisis_mmd/alpha10/{client}.pkl (also test.pkl, dev.pkl),
  text [<=32,512] in feature/text/mobilebert/crisis_mmd/alpha10/;
- kuhar: acc [T,3] in feature/acc/ku_har/fold1/{participant}.pkl, gyro [T,3] in feature/gyro/ku_har/fold1/;
- cremad: audio [<=600,80] in feature/audio/mfcc/crema_d/fold1/{speaker}.pkl, video [<=6,1280] in
  feature/video/mobilenet_v2/crema_d/fold1/.

Unpickling runs code named in the file, so the conversion reads the pickles with `SafeUnpickler`, which builds
only lists, dicts, strings, numbers and numpy arrays and refuses anything else. Run it once:

    python -m raysim.data.fedmultimodal convert crisismmd AUTHORS_OUTPUT_DIR [--out DIR]

It writes DIR/crisismmd.npz (default DIR: $RAYSIM_DATA/crisismmd), which holds no pickle: `y`, `groups` (the
position of the sample's client file among the sorted file names, the order the authors' `get_client_ids` sorts,
so `partition.id_offsets` [0, 19, 39, 59] groups KU-HAR's participants as their code does), `group_names`, `part`
(0: a client's sample, 1: the authors' test.pkl, 2: their dev.pkl) and per modality `<name>_steps` (all samples'
steps, concatenated) with `<name>_lengths`. The loader puts test.pkl's samples last (`Dataset.test_start`, the
official test set of `partition.test_pool: official`), leaves dev.pkl out, and numbers CrisisMMD's groups by their
file names (client i holds `{i}.pkl`), so that `partition.scheme: natural` with 20 clients deals the authors'
client files one per client, as their loader does. The loader packs the samples (raysim.data.modalities) with the
longest length the data have; a modality is a sequence (with a length column) where the authors' model masks it.
"""

from __future__ import annotations

import argparse
import io
import pickle
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from raysim.data.dataset import DATASETS, Dataset, RootSettings, open_npz
from raysim.data.download import default_root
from raysim.data.footprint import GROUP_BYTES, LABEL_BYTES, Footprint, member_bytes, npz_members
from raysim.data.modalities import Modalities, Modality
from raysim.errors import DataError

PARTS = {"test": 1, "dev": 2}
"""The `part` of the authors' shared files (every other file is one client's: part 0)."""


@dataclass(frozen=True)
class Source:
    """One dataset's layout in the authors' output folder: each modality's folder and whether it is a sequence."""

    name: str
    classes: int
    folders: tuple[tuple[str, str], ...]
    """(modality, folder under the authors' output folder holding one .pkl per client)."""
    sequences: frozenset[str]
    """The modalities the authors' model masks by length (the others must have one length throughout)."""
    about: str
    numbered: bool = False
    """Client files are named by client number, and client i loads `{i}.pkl` (CrisisMMD: the authors' loader
    matches int(client_id) == user_id): the loaded group id is that number, not the file's sorted position."""


SOURCES = {
    "crisismmd": Source(
        "crisismmd",
        8,
        (
            ("image", "feature/img/mobilenet_v2/crisis_mmd/alpha10"),
            ("text", "feature/text/mobilebert/crisis_mmd/alpha10"),
        ),
        frozenset({"text"}),
        "CrisisMMD humanitarian task: MobileNetV2 image + MobileBERT token features, 8 classes",
        numbered=True,
    ),
    "kuhar": Source(
        "kuhar",
        8,
        (("acc", "feature/acc/ku_har/fold1"), ("gyro", "feature/gyro/ku_har/fold1")),
        frozenset(),
        "KU-HAR: accelerometer + gyroscope windows, 8 activities, group = participant",
    ),
    "cremad": Source(
        "cremad",
        4,
        (("audio", "feature/audio/mfcc/crema_d/fold1"), ("video", "feature/video/mobilenet_v2/crema_d/fold1")),
        frozenset({"audio", "video"}),
        "Crema-D: MFCC frames + MobileNetV2 frame features, 4 emotions, group = speaker",
    ),
}

_ALLOWED = (
    {("builtins", name) for name in ("list", "dict", "tuple", "set", "frozenset", "str", "int", "float", "bool")}
    | {
        (module, name)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name in ("_reconstruct", "scalar")
    }
    | {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)
"""What an authors' feature pickle may name: containers, numbers, strings, paths and numpy arrays."""


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that builds only `_ALLOWED` objects and refuses any other callable a file names."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} (only lists, numbers, strings, numpy arrays)")


def read_pickle(file: Path) -> Any:
    """The content of one authors' pickle, read with SafeUnpickler; a DataError names the file otherwise."""
    try:
        return SafeUnpickler(io.BytesIO(file.read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
        raise DataError(f"{file}: not an authors' feature pickle ({error})") from None


def _samples(file: Path) -> tuple[list[Any], np.ndarray, list[np.ndarray]]:
    """Keys, labels and 2-D features [steps, features] of one file's samples ([key, ..., label, features])."""
    content = read_pickle(file)
    if not isinstance(content, list):
        raise DataError(f"{file}: a list of samples [key, path, label, features], got {type(content).__name__}")
    keys, labels, features = [], [], []
    for position, item in enumerate(content):
        if not isinstance(item, list | tuple) or len(item) < 3:
            raise DataError(f"{file}: sample {position} is not a list [key, path, label, features]")
        array = np.asarray(item[-1], dtype=np.float32)
        if array.ndim == 3 and array.shape[0] == 1:  # the authors' loader reads data[0] of a [1, T, d] feature
            array = array[0]
        if array.ndim == 1:
            array = array[None, :]
        if array.ndim != 2 or len(array) == 0 or not np.isfinite(array).all():
            raise DataError(f"{file}: sample {position}: features must be finite [steps, features], got {array.shape}")
        try:
            label = int(item[-2])
        except (TypeError, ValueError):  # a text label ('fear'): int() raised, a traceback
            raise DataError(f"{file}: sample {position}: the label must be a class number, got {item[-2]!r}") from None
        keys.append(item[0])
        labels.append(label)
        features.append(array)
    return keys, np.asarray(labels, np.int64), features


def convert(name: str, source_dir: Path, out_dir: Path) -> Path:
    """Read the authors' pickles of dataset `name` under `source_dir` (their output folder) and write
    `out_dir/<name>.npz` (see the module docstring); returns the file written."""
    source = SOURCES[name]
    first_name, first_folder = source.folders[0]
    first = source_dir / first_folder
    files = sorted(first.glob("*.pkl"))
    if not files:
        raise DataError(f"{first}: no .pkl files (the authors' {first_name} features of {name})")
    labels, groups, parts, names = [], [], [], []
    steps: dict[str, list[np.ndarray]] = {modality: [] for modality, _ in source.folders}
    client_files = [f for f in files if f.stem not in PARTS]
    group_of = {f.stem: g for g, f in enumerate(client_files)}
    for file in files:
        keys, y, features = _samples(file)
        for modality, folder in source.folders[1:]:
            other = source_dir / folder / file.name
            if not other.is_file():
                raise DataError(f"{other}: missing (the {modality} features paired with {file})")
            other_keys, other_y, other_features = _samples(other)
            if other_keys != keys or not np.array_equal(other_y, y):
                raise DataError(f"{other}: its samples' keys or labels differ from those of {file}")
            steps[modality] += other_features
        steps[first_name] += features
        labels.append(y)
        groups.append(np.full(len(y), group_of.get(file.stem, -1), np.int64))
        parts.append(np.full(len(y), PARTS.get(file.stem, 0), np.int8))
    y = np.concatenate(labels)
    if len(y) == 0:
        raise DataError(f"{first}: the .pkl files hold no samples (the authors' {first_name} features of {name})")
    if y.min() < 0 or y.max() >= source.classes:
        raise DataError(f"{source_dir}: labels must lie in 0..{source.classes - 1}, got {y.min()}..{y.max()}")
    arrays: dict[str, np.ndarray] = {
        "y": y,
        "groups": np.concatenate(groups),
        "part": np.concatenate(parts),
        "group_names": np.array([f.stem for f in client_files]),
    }
    for modality, arrays_of in steps.items():
        widths = {a.shape[1] for a in arrays_of}
        if len(widths) != 1:
            raise DataError(f"{source_dir}: {modality} features of different widths {sorted(widths)}")
        arrays[f"{modality}_steps"] = np.concatenate(arrays_of)
        arrays[f"{modality}_lengths"] = np.array([len(a) for a in arrays_of], np.int64)
        names.append(modality)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}.npz"
    partial = out_dir / f".{name}.npz.partial"
    try:
        with partial.open("wb") as handle:
            np.savez(handle, allow_pickle=False, **arrays)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def load_converted(name: str, file: Path) -> Dataset:
    """The converted archive `file` of dataset `name` as packed multimodal rows (see the module docstring)."""
    source = SOURCES[name]
    where = f"dataset.root: {file}"
    with open_npz(file, where, f"the archive `python -m raysim.data.fedmultimodal convert {name}` writes") as archive:
        try:
            y = archive["y"].astype(np.int64)
            groups = archive["groups"].astype(np.int64)
            part = archive["part"].astype(np.int64) if "part" in archive.files else np.zeros(len(y), np.int64)
            names = [str(n) for n in archive["group_names"]] if "group_names" in archive.files else []
            if y.ndim != 1 or len(y) == 0:
                raise DataError(f"{where}: no samples (y has shape {y.shape}); convert the authors' files again")
            values, lengths, parts = {}, {}, []
            for modality, _ in source.folders:
                steps, length = archive[f"{modality}_steps"], archive[f"{modality}_lengths"].astype(np.int64)
                if steps.ndim != 2 or length.ndim != 1:
                    raise DataError(
                        f"{where}: {modality}_steps must be 2-D [steps, features] and {modality}_lengths 1-D, got "
                        f"{steps.shape} and {length.shape}"
                    )
                if len(length) != len(y) or length.sum() != len(steps) or length.min() < 1:
                    raise DataError(f"{where}: {modality}_lengths do not match {modality}_steps and y")
                longest = int(length.max())
                sequence = modality in source.sequences
                if not sequence and length.min() != longest:
                    raise DataError(f"{where}: {modality} must have one length, got {length.min()}..{longest}")
                padded = np.zeros((len(y), longest, steps.shape[1]), np.float32)
                mask = np.arange(longest)[None, :] < length[:, None]
                padded[mask] = steps
                values[modality] = padded
                if sequence:
                    lengths[modality] = length
                parts.append(Modality(modality, (longest, steps.shape[1]), sequence=sequence))
        except KeyError as error:
            raise DataError(f"{where}: missing array {error}; convert the authors' files again") from None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:  # a damaged member
            raise DataError(f"{where}: an unreadable array ({error}); convert the authors' files again") from None
    if len(groups) != len(y) or (len(y) and (y.min() < 0 or y.max() >= source.classes)):
        raise DataError(f"{where}: groups and labels (0..{source.classes - 1}) must have one entry per sample")
    modalities = Modalities(parts)
    x = modalities.pack(values, lengths)
    if source.numbered and names and all(n.isdigit() for n in names):
        groups = np.where(groups >= 0, np.array([int(n) for n in names], np.int64)[np.maximum(groups, 0)], groups)
    order, test_start = official_order(part)
    return Dataset(
        name, x[order], y[order], source.classes, groups=groups[order], modalities=modalities, test_start=test_start
    )


def converted_footprint(name: str, file: Path) -> Footprint | None:
    """The packed rows of a converted archive from its array headers and its lengths (n integers, the only arrays
    read): x float32 (n, width), y and groups; at the peak the stored steps, the padded modalities, the packed rows
    and their copy in the official order. None when the archive is not there or not readable."""
    members = npz_members(file)
    if "y" not in members:
        return None
    samples, width, steps = members["y"][0][0], 0, 0
    try:
        with np.load(file, allow_pickle=False) as archive:
            for modality, _ in SOURCES[name].folders:
                shape, dtype = members[f"{modality}_steps"]
                longest = int(archive[f"{modality}_lengths"].max())
                width += longest * shape[1] + int(modality in SOURCES[name].sequences)
                steps += member_bytes(shape, dtype)
    except (KeyError, OSError, ValueError, IndexError, EOFError, zipfile.BadZipFile, zlib.error):
        return None  # load says what is wrong with it
    nbytes = samples * (4 * width + LABEL_BYTES + GROUP_BYTES)
    return Footprint(samples, nbytes, steps + 3 * nbytes)


def official_order(part: np.ndarray) -> tuple[np.ndarray, int | None]:
    """The loaded samples: the clients' files' (part 0), then the authors' test.pkl (part 1) from `test_start` on,
    the official test set that `partition.test_pool: official` scores every client on (their CrisisMMD loader's
    test_loader); their dev.pkl (part 2) is left out, as their training code never reads it. None: no test.pkl."""
    clients, test = np.flatnonzero(part == 0), np.flatnonzero(part == PARTS["test"])
    return np.concatenate([clients, test]), (len(clients) if len(test) else None)


class _ConvertedSettings(RootSettings):
    """A dataset converted from the authors' feature pickles (`python -m raysim.data.fedmultimodal convert`)."""

    layout: ClassVar[str] = "<root>/<name>.npz written by `python -m raysim.data.fedmultimodal convert`"

    def file(self) -> Path:
        """dataset.root/<name>.npz, by default $RAYSIM_DATA/<name>/<name>.npz."""
        root = Path(self.root).expanduser() if self.root else default_root() / self.name
        return root / f"{self.name}.npz"

    def footprint(self) -> Footprint | None:
        return converted_footprint(self.name, self.file())

    def load(self, seed: int) -> Dataset:
        file = self.file()
        if not file.is_file():
            raise DataError(
                f"dataset.root: {file}: missing; convert the authors' feature pickles once with `python -m "
                f"raysim.data.fedmultimodal convert {self.name} AUTHORS_OUTPUT_DIR --out {file.parent}` (or use "
                f"dataset.name {self.name}_synthetic)"
            )
        return load_converted(self.name, file)


_GET = (
    "run FedAPM's data/run_download_data.sh, run_data_partitioning.sh and run_feature_processing.sh "
    "(github.com/NieFeiteng/FedAPM), then `python -m raysim.data.fedmultimodal convert {name} data/output`"
)


@DATASETS.register()
class CrisisMMDSettings(_ConvertedSettings):
    name: Literal["crisismmd"] = "crisismmd"
    about: ClassVar[str] = SOURCES["crisismmd"].about
    get: ClassVar[str] = _GET.format(name="crisismmd")
    markers: ClassVar[tuple[str, ...]] = ("crisismmd.npz", "crisismmd/crisismmd.npz")


@DATASETS.register()
class KUHARSettings(_ConvertedSettings):
    name: Literal["kuhar"] = "kuhar"
    about: ClassVar[str] = SOURCES["kuhar"].about
    get: ClassVar[str] = _GET.format(name="kuhar")
    markers: ClassVar[tuple[str, ...]] = ("kuhar.npz", "kuhar/kuhar.npz")


@DATASETS.register()
class CremaDSettings(_ConvertedSettings):
    name: Literal["cremad"] = "cremad"
    about: ClassVar[str] = SOURCES["cremad"].about
    get: ClassVar[str] = _GET.format(name="cremad")
    markers: ClassVar[tuple[str, ...]] = ("cremad.npz", "cremad/cremad.npz")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raysim.data.fedmultimodal",
        description="Convert the authors' FedMultimodal-style feature pickles once into a safe .npz archive.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("convert", help="read the authors' pickles (restricted unpickler), write NAME.npz")
    command.add_argument("name", choices=sorted(SOURCES))
    command.add_argument("source", help="the authors' output folder (the one holding feature/)")
    command.add_argument("--out", default=None, help="folder to write NAME.npz to (default $RAYSIM_DATA/NAME)")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser() if args.out else default_root() / args.name
    try:
        target = convert(args.name, Path(args.source).expanduser(), out)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
