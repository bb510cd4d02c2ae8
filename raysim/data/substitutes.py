"""Offline substitutes for FedAPM's multimodal benchmarks: generated features of the exact shapes the
authors' models read (FedAPM, Table 2, App. B.1), so that the same models and algorithms run on a machine with no
download.

They are substitutes, not the data sets: every name ends in `_synthetic`, and no number measured on them compares
with the paper's. What they keep of the real sets is their structure:
- class-conditional features: each class has its own mean per modality, and a modality's `signal` scales how far
  apart the classes' means lie (its informativeness: a weak modality still helps, a strong one alone nearly
  suffices);
- natural ids (`groups`: synthetic participants or speakers) with their own shift of every feature (feature skew,
  for the `natural` partition);
- variable-length sequences where the real ones vary (tweet tokens, audio frames), zero beyond each length;
- CrisisMMD's split as the authors' files hold it: an official test set kept last (`Dataset.test_start`, their
  test.pkl) and the training samples' groups their client files, dealt as their partition script deals them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.data.dataset import DATASETS, Dataset, DatasetSettings
from raysim.data.footprint import GROUP_BYTES, LABEL_BYTES, Footprint
from raysim.data.modalities import Modalities, Modality
from raysim.errors import DataError

FILE_ATTEMPTS = 1000
"""Deals of the client files drawn before giving up on one that leaves every file a sample (the authors redraw
without end; a deal of 34 samples into 20 files succeeds about one time in 40)."""

BASIC_MOTIONS = ("BasicMotions/BasicMotions_TRAIN.ts", "BasicMotions/BasicMotions_TEST.ts")
"""sktime's bundled BasicMotions (under sktime/datasets/data/): 80 real smartwatch recordings, 4 activities, 3-axis
accelerometer (dimensions 0-2) and gyroscope (3-5), 100 steps at 10 Hz."""


def _class_features(
    generator: np.random.Generator,
    labels: np.ndarray,
    groups: np.ndarray,
    shape: tuple[int, ...],
    signal: float,
    group_shift: float,
) -> np.ndarray:
    """Features (n, *shape) float32: the class's mean (one vector over the last axis, N(0, signal^2) per class),
    plus the group's shift (N(0, group_shift^2)), plus unit Gaussian noise for every value."""
    features = shape[-1]
    means = generator.normal(0.0, signal, size=(labels.max() + 1, features)).astype(np.float32)
    shifts = generator.normal(0.0, group_shift, size=(groups.max() + 1, features)).astype(np.float32)
    values = generator.standard_normal(size=(len(labels), *shape), dtype=np.float32)
    expand = (slice(None),) + (None,) * (len(shape) - 1) + (slice(None),)
    values += (means[labels] + shifts[groups])[expand]
    return values


def _lengths(generator: np.random.Generator, count: int, shortest: int, longest: int) -> np.ndarray:
    return generator.integers(shortest, longest + 1, size=count)


def _rows(modalities: Modalities, samples: int, peak_factor: float) -> Footprint:
    """A substitute's memory: packed float32 rows, int64 labels and groups; loading draws every modality unpacked
    and packs them (about 3 copies of x at the peak: `peak_factor`, measured)."""
    row = 4 * modalities[0] + LABEL_BYTES + GROUP_BYTES
    return Footprint.rows(samples, row, peak_factor, "dataset.samples")


def _labels_and_groups(
    generator: np.random.Generator, samples: int, classes: int, num_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """Group ids (each group the same number of samples, give or take one) and uniform class labels."""
    groups = np.sort(np.arange(samples) % num_groups)
    return generator.integers(0, classes, size=samples), groups


@DATASETS.register()
class CrisisMMDSyntheticSettings(DatasetSettings):
    """CrisisMMD-shaped substitute: image [1,1280] + tweet tokens [<=32,512], 8 classes."""

    name: Literal["crisismmd_synthetic"] = "crisismmd_synthetic"
    samples: int = Field(
        4000, ge=16, description="samples (CrisisMMD has 18,100; a padded sample is 69 KB, so the default keeps fewer)"
    )
    classes: int = Field(8, ge=2, description="humanitarian classes (8 in the authors' code)")
    tokens: int = Field(32, ge=1, description="longest tweet, in tokens (32 in the authors' features)")
    image_dim: int = Field(1280, ge=1, description="image feature size (MobileNetV2: 1280)")
    text_dim: int = Field(512, ge=1, description="token feature size (MobileBERT: 512)")
    image_signal: float = Field(0.3, ge=0, description="spread of the classes' image means (informativeness)")
    text_signal: float = Field(0.15, ge=0, description="spread of the classes' token means (informativeness)")
    sources: int = Field(
        40,
        ge=1,
        description="synthetic sources (as the disasters the tweets come from), each with its own feature shift; "
        "spread over the client files",
    )
    group_shift: float = Field(0.2, ge=0, description="spread of a source's feature shift")
    client_files: int = Field(
        20,
        ge=1,
        description="the authors' client files (FedAPM, App. B.1: one per client, 20): the training samples' groups, "
        "dealt by Dirichlet(file_beta) label skew as their partition script deals CrisisMMD's train split, so that "
        "`partition.scheme: natural` with as many clients gives each one file",
    )
    file_beta: float = Field(1.0, gt=0, description="the Dirichlet concentration of that deal (the authors' alpha 1.0)")
    test_ratio: float = Field(
        0.1644,
        ge=0,
        description="official test samples per training sample, kept last (Dataset.test_start, for "
        "`partition.test_pool: official`): the authors' test.pkl holds CrisisMMD's 2,237 humanitarian test pairs "
        "against the 13,608 of the train split in their client files; 0: no official test set, every sample a "
        "client file's",
    )
    about: ClassVar[str] = "CrisisMMD-shaped synthetic image + text features (offline substitute)"
    seeded: ClassVar[bool] = True

    def modalities(self) -> Modalities:
        return Modalities(
            [Modality("image", (1, self.image_dim)), Modality("text", (self.tokens, self.text_dim), sequence=True)]
        )

    def footprint(self) -> Footprint:
        return _rows(self.modalities(), self.samples, 3.0)

    def load(self, seed: int) -> Dataset:
        """The samples, the last `held_out` of them the official test set (group -1, as the converted test.pkl),
        the others grouped by client file (`client_files`). The split and the deal come from their own stream; the
        sources are spread over the samples (shuffled) only when a test set is kept, so that it is a uniform draw."""
        generator = np.random.default_rng([seed, 0xC815])
        deal = np.random.default_rng([seed, 0xC815, 1])
        labels, sources = _labels_and_groups(generator, self.samples, self.classes, self.sources)
        test = self.held_out()
        train = self.samples - test
        if train < self.client_files:
            raise DataError(
                f"dataset.samples={self.samples}: {train} training samples (after the test_ratio={self.test_ratio} "
                f"test set) cannot fill dataset.client_files={self.client_files}; raise samples or lower client_files"
            )
        if test:
            sources = deal.permutation(sources)
        modalities = self.modalities()
        image = _class_features(generator, labels, sources, (1, self.image_dim), self.image_signal, self.group_shift)
        text = _class_features(
            generator, labels, sources, (self.tokens, self.text_dim), self.text_signal, self.group_shift
        )
        lengths = _lengths(generator, self.samples, min(4, self.tokens), self.tokens)
        x = modalities.pack({"image": image, "text": text}, {"text": lengths})
        groups = np.full(self.samples, -1, np.int64)
        groups[:train] = deal_client_files(labels[:train], self.client_files, self.file_beta, deal)
        return Dataset(
            self.name,
            x,
            labels.astype(np.int64),
            self.classes,
            groups=groups,
            modalities=modalities,
            test_start=train if test else None,
        )

    def held_out(self) -> int:
        """The size of the official test set: round(samples * r / (1 + r)) for test_ratio r, so that test / train
        is r."""
        return round(self.samples * self.test_ratio / (1 + self.test_ratio))


def deal_client_files(
    labels: np.ndarray, files: int, beta: float, generator: np.random.Generator, min_size: int = 1
) -> np.ndarray:
    """The client file (0..files-1) of each sample, dealt as the FedAPM authors' partition script deals CrisisMMD's
    train split into alpha10/{i}.pkl (FedMultimodal's Dirichlet partition, FedAPM, Table 2, App. B.1): class by class,
    shares p ~ Dir(beta 1_files), zeroed for the files already holding n / files samples or more and renormalized, cut
    the class's shuffled samples at floor(cumsum(p) * size); the whole deal is drawn again until every file holds
    `min_size` (theirs: 1 for CrisisMMD)."""
    n = len(labels)
    for _attempt in range(FILE_ATTEMPTS):
        file_of = np.empty(n, np.int64)
        sizes = np.zeros(files, np.int64)
        for k in np.unique(labels):
            members = generator.permutation(np.flatnonzero(labels == k))
            shares = generator.dirichlet(np.full(files, beta)) * (sizes < n / files)
            cuts = (np.cumsum(shares / shares.sum()) * len(members)).astype(int)[:-1]
            for file, chunk in enumerate(np.split(members, cuts)):
                file_of[chunk] = file
                sizes[file] += len(chunk)
        if sizes.min() >= min_size:
            return file_of
    raise DataError(
        f"dataset.client_files={files}: {FILE_ATTEMPTS} Dirichlet deals of {n} training samples all left a file "
        f"with fewer than {min_size}; raise dataset.samples or dataset.file_beta, or lower client_files"
    )


@DATASETS.register()
class CremaDSyntheticSettings(DatasetSettings):
    """Crema-D-shaped substitute: MFCC frames [<=600,80] + video frame features [6,1280], 4 emotions, 72 speakers."""

    name: Literal["cremad_synthetic"] = "cremad_synthetic"
    samples: int = Field(2000, ge=16, description="samples (Crema-D's 4 emotions: 4,798; a padded sample is 223 KB)")
    classes: int = Field(4, ge=2, description="emotions (Crema-D's 4 in the authors' features)")
    frames: int = Field(600, ge=8, description="longest clip, in MFCC frames (600 in the authors' features)")
    mfcc: int = Field(80, ge=1, description="MFCCs per frame")
    video_frames: int = Field(6, ge=1, description="video frames per clip, each a feature vector of video_dim")
    video_dim: int = Field(1280, ge=1, description="frame feature size (MobileNetV2: 1280)")
    audio_signal: float = Field(0.3, ge=0, description="spread of the classes' MFCC means (informativeness)")
    video_signal: float = Field(0.1, ge=0, description="spread of the classes' frame-feature means")
    speakers: int = Field(72, ge=1, description="synthetic speakers (groups), each with its own feature shift")
    group_shift: float = Field(0.3, ge=0, description="spread of a speaker's feature shift")
    about: ClassVar[str] = "Crema-D-shaped synthetic audio + video features (offline substitute)"
    seeded: ClassVar[bool] = True

    def modalities(self) -> Modalities:
        return Modalities(
            [
                Modality("audio", (self.frames, self.mfcc), sequence=True),
                Modality("video", (self.video_frames, self.video_dim)),
            ]
        )

    def footprint(self) -> Footprint:
        return _rows(self.modalities(), self.samples, 3.0)

    def load(self, seed: int) -> Dataset:
        generator = np.random.default_rng([seed, 0xC3E7])
        labels, groups = _labels_and_groups(generator, self.samples, self.classes, self.speakers)
        modalities = self.modalities()
        audio = _class_features(
            generator, labels, groups, (self.frames, self.mfcc), self.audio_signal, self.group_shift
        )
        video = _class_features(
            generator, labels, groups, (self.video_frames, self.video_dim), self.video_signal, self.group_shift
        )
        lengths = _lengths(generator, self.samples, max(8, self.frames // 3), self.frames)
        x = modalities.pack({"audio": audio, "video": video}, {"audio": lengths})
        return Dataset(self.name, x, labels.astype(np.int64), self.classes, groups=groups, modalities=modalities)


@DATASETS.register()
class KUHARSyntheticSettings(DatasetSettings):
    """KU-HAR-shaped substitute: accelerometer [256,3] + gyroscope [256,3], 8 activities, synthetic participants
    (a generated IMU signal), optionally on top of sktime's real BasicMotions recordings."""

    name: Literal["kuhar_synthetic"] = "kuhar_synthetic"
    samples: int = Field(4000, ge=16, description="windows (KU-HAR: 10,300)")
    classes: int = Field(8, ge=2, description="activities")
    window: int = Field(256, ge=8, description="samples per window")
    participants: int = Field(80, ge=1, description="synthetic participants (groups)")
    noise: float = Field(0.5, ge=0, description="sensor noise (standard deviation)")
    recordings: Literal["none", "basic_motions"] = Field(
        "none",
        description="basic_motions: each window adds a real recording of sktime's BasicMotions (activity k % 4, "
        "resampled to the window, circularly shifted) under the generated pattern; needs sktime installed",
    )
    about: ClassVar[str] = "KU-HAR-shaped synthetic accelerometer + gyroscope windows (offline substitute)"
    seeded: ClassVar[bool] = True

    def footprint(self) -> Footprint:
        """The windows are drawn in float64, several arrays of them at once (about 6 copies of x at the peak)."""
        modalities = Modalities([Modality("acc", (self.window, 3)), Modality("gyro", (self.window, 3))])
        return _rows(modalities, self.samples, 6.0)

    def load(self, seed: int) -> Dataset:
        """Each activity has its own frequency, and per axis and sensor an amplitude and phase; a participant
        scales every signal by a gain and adds an offset per axis; a window starts at a random phase. With
        `recordings: basic_motions` every window also carries a real BasicMotions recording of activity k % 4 (so
        activities k and k + 4 share the real motion and differ in the generated pattern), drawn from its own
        stream so the generated part is the same as without it."""
        generator = np.random.default_rng([seed, 0x4A12])
        labels, groups = _labels_and_groups(generator, self.samples, self.classes, self.participants)
        modalities = Modalities([Modality("acc", (self.window, 3)), Modality("gyro", (self.window, 3))])
        frequencies = generator.uniform(0.5, 4.0, size=self.classes) / 50.0  # cycles per sample at 50 Hz
        time = np.arange(self.window, dtype=np.float32)
        base = {"acc": np.zeros(1, np.float32), "gyro": np.zeros(1, np.float32)}
        if self.recordings == "basic_motions":
            base = basic_motions_windows(labels, self.window, np.random.default_rng([seed, 0x4A12, 1]))
        values = {}
        for sensor in ("acc", "gyro"):
            amplitudes = generator.uniform(0.2, 2.0, size=(self.classes, 3))
            phases = generator.uniform(0, 2 * np.pi, size=(self.classes, 3))
            gains = np.exp(generator.normal(0.0, 0.2, size=self.participants))
            offsets = generator.normal(0.0, 0.5, size=(self.participants, 3))
            start = generator.uniform(0, 2 * np.pi, size=self.samples)
            angle = 2 * np.pi * frequencies[labels][:, None, None] * time[None, :, None]
            wave = amplitudes[labels][:, None, :] * np.sin(angle + phases[labels][:, None, :] + start[:, None, None])
            noise = self.noise * generator.standard_normal(size=wave.shape)
            signal = gains[groups][:, None, None] * (base[sensor] + wave) + offsets[groups][:, None, :] + noise
            values[sensor] = signal.astype(np.float32)
        x = modalities.pack(values)
        return Dataset(self.name, x, labels.astype(np.int64), self.classes, groups=groups, modalities=modalities)


def basic_motions() -> tuple[np.ndarray, np.ndarray]:
    """sktime's BasicMotions read from the installed package's .ts files (without importing sktime): the series
    (80, 6, 100) float32 and their activity (0..3, the order of the files' @classLabel line)."""
    spec = importlib.util.find_spec("sktime")
    if spec is None or spec.origin is None:
        raise DataError("dataset.recordings=basic_motions needs sktime installed (its wheel ships BasicMotions)")
    folder = Path(spec.origin).parent / "datasets" / "data"
    series, labels, classes = [], [], []
    for name in BASIC_MOTIONS:
        file = folder / name
        try:
            lines = file.read_text().splitlines()
        except OSError as error:
            raise DataError(f"{file}: sktime's BasicMotions is not readable ({error})") from None
        data = False
        for line in lines:
            if line.lower().startswith("@classlabel"):
                classes = [c.lower() for c in line.split()[2:]]
            elif line.lower().startswith("@data"):
                data = True
            elif data and line.strip():
                *dimensions, label = line.strip().split(":")
                series.append([[float(v) for v in dimension.split(",")] for dimension in dimensions])
                labels.append(classes.index(label.lower()))
    array = np.asarray(series, np.float32)
    if array.shape != (80, 6, 100):
        raise DataError(f"{folder / 'BasicMotions'}: 80 series of 6 dimensions x 100 steps, got {array.shape}")
    return array, np.asarray(labels, np.int64)


def basic_motions_windows(labels: np.ndarray, window: int, generator: np.random.Generator) -> dict[str, np.ndarray]:
    """Per sample, a BasicMotions recording of activity label % 4 drawn at random, linearly resampled to `window`
    steps and circularly shifted by a random start: acc and gyro (n, window, 3)."""
    series, activity = basic_motions()
    steps = series.shape[2]
    grid = np.linspace(0, steps - 1, window)
    resampled = np.stack([[np.interp(grid, np.arange(steps), channel) for channel in s] for s in series])
    chosen = np.array([generator.choice(np.flatnonzero(activity == label % 4)) for label in labels], np.int64)
    shifts = generator.integers(0, window, size=len(labels))
    rows = (np.arange(window)[None, :] + shifts[:, None]) % window
    windows = np.take_along_axis(resampled[chosen], rows[:, None, :], axis=2).transpose(0, 2, 1)  # (n, window, 6)
    return {"acc": windows[:, :, :3], "gyro": windows[:, :, 3:]}
