"""Issue 31's data: natural ids grouped several to a client as FedAPM's KU-HAR code does (`partition.id_offsets`),
one global test split for every client (`partition.test_split: global`, its CrisisMMD code), and the loaders of the
real CrisisMMD, KU-HAR and Crema-D features, read from fixture pickles written in the authors' layout."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.data import DataError, PartitionError, load_dataset, partition_dataset
from raysim.data.fedmultimodal import SOURCES, convert, main, read_pickle
from raysim.data.partitions import DirichletSettings, LabelPriorSettings, NaturalSettings
from raysim.data.substitutes import basic_motions, basic_motions_windows
from raysim.evaluation.columns import client_evaluations
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

KUHAR_OFFSETS = [0, 19, 39, 59]


def _ids_of(split, groups: np.ndarray) -> set[int]:
    return {int(g) for g in groups[np.concatenate([split.train, split.test, split.val])]}


def test_id_offsets_give_client_i_the_ids_at_i_19_39_59():
    """FedAPM's get_dataloaders_for_ku_har: client i = sorted ids [i, i+19, i+39, i+59]; so client 0 and client 19
    share the id at position 19, as in that code; all of an id's samples go with it."""
    ids = np.arange(100, 180)  # 80 participants, ids not starting at 0: positions, not values, are dealt
    groups = np.repeat(ids, 6)
    labels = np.arange(len(groups)) % 8
    splits = partition_dataset(labels, 20, NaturalSettings(id_offsets=KUHAR_OFFSETS), 3, groups)
    for client, split in enumerate(splits):
        assert _ids_of(split, groups) == {int(ids[client + o]) for o in KUHAR_OFFSETS}
        assert split.num_samples == 4 * 6
    assert _ids_of(splits[0], groups) & _ids_of(splits[19], groups) == {int(ids[19])}
    with pytest.raises(PartitionError, match=r"needs 80 group ids; the dataset has 79"):
        partition_dataset(labels[6:], 21, NaturalSettings(id_offsets=KUHAR_OFFSETS), 3, groups[6:])
    with pytest.raises(ValueError, match="partition.id_offsets"):
        NaturalSettings(id_offsets=[-1])


def test_a_global_test_split_is_shared_by_every_client_and_trained_on_by_none():
    labels = np.arange(600) % 8
    settings = DirichletSettings(beta=1.0, test_split="global", val_fraction=0.1)
    splits = partition_dataset(labels, 6, settings, 5)
    shared = splits[0].test
    assert len(shared) == 120 and all(np.array_equal(s.test, shared) for s in splits)
    trained = np.concatenate([np.concatenate([s.train, s.val]) for s in splits])
    assert not np.intersect1d(trained, shared).size and len(np.unique(trained)) == len(trained) == 480
    assert all(len(s.val) >= 1 for s in splits)
    again, other = partition_dataset(labels, 6, settings, 5), partition_dataset(labels, 6, settings, 6)
    assert all(
        np.array_equal(a.train, s.train) and np.array_equal(a.test, s.test) for a, s in zip(again, splits, strict=True)
    )
    assert not np.array_equal(other[0].test, shared)
    client_split = partition_dataset(labels, 6, DirichletSettings(beta=1.0), 5)
    assert not np.array_equal(client_split[0].test, client_split[1].test)  # the default: each client's own


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (lambda: LabelPriorSettings(test_split="global"), "scheme=label_prior draws its own test sets"),
        (lambda: DirichletSettings(test_split="global", draw="authors", overlap=True), "draw=authors"),
        (lambda: validate_config(tiny_config(partition={"scheme": "meta", "test_split": "global"})), "meta"),
    ],
)
def test_a_global_test_split_is_refused_where_the_scheme_draws_its_own(settings, message):
    with pytest.raises(Exception, match=message):
        settings()


def test_a_too_small_global_test_split_is_refused():
    with pytest.raises(PartitionError, match="partition.test_split=global: partition.test_fraction=0.01"):
        partition_dataset(np.arange(40) % 2, 4, DirichletSettings(test_split="global", test_fraction=0.01), 0)


def test_every_client_is_scored_on_the_global_test_split_in_both_executors():
    """In process, through the real host: one FLAME round per executor; the shared GM scores the same on every
    client's (the one shared) test split, the personal models differ, and the executors agree."""
    runs = {}
    for mode in ("sequential", "vectorized"):
        config = validate_config(
            tiny_config(
                partition={"scheme": "dirichlet", "beta": 1.0, "test_split": "global"},
                runtime={"num_hosts": 1, "client_training": mode, "vectorize_chunk": 4},
            )
        )
        sim = InProcess(config)
        sim.round(0)
        evaluations = client_evaluations(sim.host.evaluate(sim.coordinator.global_model()))
        assert len(evaluations) == 4
        assert len({e.gm.test_acc for e in evaluations}) == 1 and len({e.gm.test_loss for e in evaluations}) == 1
        assert len({e.pm.test_loss for e in evaluations}) == 4
        runs[mode] = (sim.coordinator.global_model(), [e.pm.test_loss for e in evaluations])
    np.testing.assert_allclose(runs["vectorized"][0], runs["sequential"][0], atol=1e-5)
    np.testing.assert_allclose(runs["vectorized"][1], runs["sequential"][1], rtol=1e-4)


def _features(generator: np.random.Generator, label: int, steps: int, width: int, shape3: bool = False) -> np.ndarray:
    """Class-dependent features as the authors' scripts store them (float32 numpy; an image as [1, 1, d])."""
    array = (generator.normal(size=(steps, width)) + label).astype(np.float32)
    return array[None] if shape3 else array


def write_authors_files(root: Path, name: str, clients: dict[str, list[int]], seed: int = 0) -> None:
    """Pickles in the authors' layout (see raysim.data.fedmultimodal): per client and modality a list of
    [key, path, label, features], the modalities paired by position; `clients` maps a file stem to its labels."""
    generator = np.random.default_rng(seed)
    (first, first_folder), (second, second_folder) = SOURCES[name].folders
    shapes = {
        "crisismmd": lambda: ((1, 12), (int(generator.integers(2, 7)), 5)),
        "kuhar": lambda: ((16, 3), (16, 3)),
        "cremad": lambda: ((int(generator.integers(3, 10)), 8), (int(generator.integers(2, 4)), 6)),
    }[name]
    for stem, labels in clients.items():
        a_items, b_items = [], []
        for position, label in enumerate(labels):
            (a_steps, a_width), (b_steps, b_width) = shapes()
            key = f"{stem}/{position}"
            a_items.append(
                [key, f"/raw/{key}.jpg", label, _features(generator, label, a_steps, a_width, name == "crisismmd")]
            )
            b_items.append([key, f"/raw/{key}.txt", label, _features(generator, label, b_steps, b_width)])
        for folder, items in ((first_folder, a_items), (second_folder, b_items)):
            (root / folder).mkdir(parents=True, exist_ok=True)
            with (root / folder / f"{stem}.pkl").open("wb") as handle:
                pickle.dump(items, handle, protocol=pickle.HIGHEST_PROTOCOL)


def test_crisismmd_features_convert_and_load_as_packed_rows(tmp_path):
    authors = tmp_path / "output"
    write_authors_files(authors, "crisismmd", {"0": [0, 1, 2], "1": [3, 4], "test": [5, 6, 7], "dev": [1]})
    target = convert("crisismmd", authors, tmp_path / "data")
    assert target == tmp_path / "data" / "crisismmd.npz"
    dataset = load_dataset("crisismmd", root=tmp_path / "data")
    modalities = dataset.modalities
    assert modalities.names == ("image", "text") and modalities.part("image").shape == (1, 12)
    assert modalities.part("text").sequence and modalities.part("text").shape[1] == 5
    # the clients' files (0, 1), then the authors' test.pkl from test_start on, dev.pkl left out (never read)
    assert dataset.num_classes == 8 and dataset.y.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert dataset.groups.tolist() == [0, 0, 0, 1, 1, -1, -1, -1] and dataset.test_start == 5
    values, lengths = modalities.unpack(dataset.x)
    for row, stem, item in [(3, "1", 0), (4, "1", 1), (7, "test", 2)]:
        original = read_pickle(authors / SOURCES["crisismmd"].folders[1][1] / f"{stem}.pkl")[item][3]
        assert lengths["text"][row] == len(original)
        np.testing.assert_array_equal(values["text"][row, : len(original)], original)
        assert not values["text"][row, len(original) :].any()
    image = read_pickle(authors / SOURCES["crisismmd"].folders[0][1] / "0.pkl")[2][3]
    np.testing.assert_array_equal(values["image"][2], image[0])


def test_crisismmd_as_the_authors_split_it_one_client_file_each_scored_on_their_test_file(tmp_path):
    """The authors' CrisisMMD loader (NieFeiteng/FedAPM get_multimodal.py): client i trains on all of `{i}.pkl`
    and every client is scored on `test.pkl`; `dev.pkl` is never read. Eleven client files, so that the sorted names
    (0, 1, 10, 2, ...) differ from the numbers: `natural` over the loaded groups with 11 clients and
    `test_split: global` with `test_pool: official` gives client i exactly file i's samples (keys `{i}/...`) for
    training and test.pkl's, exactly, for testing."""
    authors = tmp_path / "output"
    files = {str(i): [i % 8, (i + 3) % 8, (i + 5) % 8] for i in range(11)} | {"test": [0, 1, 2, 3], "dev": [4, 5]}
    write_authors_files(authors, "crisismmd", files)
    convert("crisismmd", authors, tmp_path / "data")
    dataset = load_dataset("crisismmd", root=tmp_path / "data")
    image = SOURCES["crisismmd"].folders[0][1]
    rows = {
        stem: [read_pickle(authors / image / f"{stem}.pkl")[k][3][0] for k in range(len(labels))]
        for stem, labels in files.items()
    }
    values, _ = dataset.modalities.unpack(dataset.x)

    def stems_of(indices: np.ndarray) -> list[str]:
        found = []
        for index in indices:
            (stem,) = [
                s for s, images in rows.items() if any(np.array_equal(values["image"][index], a) for a in images)
            ]
            found.append(stem)
        return found

    settings = NaturalSettings(test_split="global", test_pool="official")
    splits = partition_dataset(dataset.y, 11, settings, 0, dataset.groups, dataset.test_start)
    for client, split in enumerate(splits):
        assert sorted(stems_of(split.train)) == [str(client)] * 3 and len(split.val) == 0
        assert sorted(stems_of(split.test)) == ["test"] * 4
        assert dataset.y[split.test].tolist() == files["test"]
    dealt = np.concatenate([s.train for s in splits])
    assert sorted(dealt.tolist()) == list(range(dataset.test_start)) and "dev" not in stems_of(range(len(dataset.y)))


def test_kuhar_participants_group_as_the_authors_code_deals_them(tmp_path):
    """Converted KU-HAR: `groups` is each participant file's position among the sorted names (their
    get_client_ids), so id_offsets [0, 19, 39, 59] gives client i the files at i, i+19, i+39, i+59."""
    authors = tmp_path / "output"
    names = [str(1000 + p) for p in range(80)]
    write_authors_files(authors, "kuhar", {name: [p % 8, (p + 1) % 8, (p + 2) % 8] for p, name in enumerate(names)})
    main(["convert", "kuhar", str(authors), "--out", str(tmp_path / "data")])
    dataset = load_dataset("kuhar", root=tmp_path / "data")
    assert dataset.modalities.part("acc").shape == (16, 3) and not dataset.modalities.part("gyro").sequence
    splits = partition_dataset(dataset.y, 20, NaturalSettings(id_offsets=KUHAR_OFFSETS), 0, dataset.groups)
    assert _ids_of(splits[1], dataset.groups) == {1, 20, 40, 60}


def test_cremad_video_of_varying_length_is_a_sequence(tmp_path):
    authors = tmp_path / "output"
    write_authors_files(authors, "cremad", {f"10{s:02d}": [s % 4, (s + 1) % 4] for s in range(5)})
    convert("cremad", authors, tmp_path)
    dataset = load_dataset("cremad", root=str(tmp_path))
    assert dataset.modalities.part("audio").sequence and dataset.modalities.part("video").sequence
    assert dataset.num_classes == 4 and sorted(set(dataset.groups.tolist())) == [0, 1, 2, 3, 4]


def test_a_pickle_that_names_other_code_is_refused_and_nothing_is_written(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    authors = tmp_path / "output"
    write_authors_files(authors, "kuhar", {"1": [0, 1]})
    folder = authors / SOURCES["kuhar"].folders[0][1]
    (folder / "1.pkl").write_bytes(pickle.dumps([[0, "x", 1, Payload()]]))
    with pytest.raises(DataError, match=r"1\.pkl: not an authors' feature pickle \(refused to load posix.system"):
        convert("kuhar", authors, tmp_path / "data")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "data" / "kuhar.npz").exists()


def test_a_missing_converted_file_is_refused_with_one_line_naming_it(tmp_path):
    with pytest.raises(DataError) as refused:
        load_dataset("cremad", root=str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and str(tmp_path / "cremad.npz") in message
    assert "python -m raysim.data.fedmultimodal convert cremad" in message


def test_basic_motions_is_read_from_the_installed_sktime_wheel():
    series, activity = basic_motions()
    assert series.shape == (80, 6, 100) and np.bincount(activity).tolist() == [20, 20, 20, 20]
    assert np.isfinite(series).all() and series[:, :3].std() > 0.1 and series[:, 3:].std() > 0.1


def test_every_window_carries_a_shifted_basic_motions_recording_of_its_activity():
    """At the recordings' own length (no resampling) each window is a circular shift of a recording of activity
    label % 4, accelerometer and gyroscope of the same recording."""
    series, activity = basic_motions()
    labels = np.arange(24) % 8
    windows = basic_motions_windows(labels, 100, np.random.default_rng(0))
    both = np.concatenate([windows["acc"], windows["gyro"]], axis=2).transpose(0, 2, 1)  # (n, 6, 100)
    for sample, label in enumerate(labels):
        candidates = np.flatnonzero(activity == label % 4)
        starts = np.argwhere(np.isclose(series[candidates], both[sample][:, :1]).all(axis=1))  # (recording, shift)
        assert any(np.allclose(np.roll(series[candidates[r]], -shift, axis=1), both[sample]) for r, shift in starts), (
            sample
        )


def test_the_kuhar_substitute_on_basic_motions_keeps_its_generated_part_and_seed():
    generated = load_dataset("kuhar_synthetic", seed=3, samples=200)
    recorded = load_dataset("kuhar_synthetic", seed=3, samples=200, recordings="basic_motions")
    again = load_dataset("kuhar_synthetic", seed=3, samples=200, recordings="basic_motions")
    assert recorded.modalities == generated.modalities and recorded.x.shape == (200, 2 * 256 * 3)
    assert np.array_equal(recorded.y, generated.y) and np.array_equal(recorded.groups, generated.groups)
    assert np.array_equal(recorded.x, again.x) and np.abs(recorded.x - generated.x).mean() > 0.1
    assert sorted(set(recorded.y.tolist())) == list(range(8))
