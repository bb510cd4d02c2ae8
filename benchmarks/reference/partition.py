"""The one partition both sides of the reference check read (benchmarks/reference/README.md).

Fashion-MNIST pooled as both libraries pool it (the 60,000 training images, then the 10,000 test images; FL-bench's
`FashionMNIST` dataset and raysim's `fashion_mnist` source agree on the order), a seeded random subset of `samples`
images (the check must stay cheap), dealt to `clients` clients by FL-bench's Dirichlet scheme
(data/utils/schemes/dirichlet.py: per class, shuffle its samples and cut them by the cumulative shares of a
Dir(alpha) draw over the clients; redraw everything until every client has `min_samples`), then split per client
as FL-bench's generate_data.py does with `--split sample`: shuffle, the first int(test_ratio n) are the test set,
the rest the training set. The draws come from one numpy Generator (not FL-bench's global legacy stream), so the
partition is the same from either venv.

Outputs: `partition.parquet` (raysim's `partition: {scheme: file}`: client_id, train, test), `partition_val.parquet`
(the same with `val` = the first int(0.2 n_train) of a shuffle of each client's training set, taken out of `train`:
raysim's FedFomo measures its weights on a validation split; FL-bench's FedFomo redraws its 20% every round), and,
with `--flbench ROOT`, FL-bench's `data/fmnist/partition.pkl` and `args.json` (the same indices) plus links to the
raw IDX files in `data/fmnist/FashionMNIST/raw/`.

    python benchmarks/reference/partition.py --out /tmp/ref --flbench /tmp/flbench
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SETTING = {"seed": 42, "clients": 20, "alpha": 0.1, "samples": 6000, "min_samples": 40, "test_ratio": 0.25}
"""The recorded setting (curves.json repeats it)."""
VAL_RATIO = 0.2
"""FL-bench's FedFomo `valset_ratio`."""


@dataclass
class ClientPart:
    train: np.ndarray
    test: np.ndarray
    val: np.ndarray


def fashion_mnist_labels(root: str | None = None) -> np.ndarray:
    from raysim.data.fashion_mnist import load_fashion_mnist

    return load_fashion_mnist(root, download=False)[1]


def dirichlet_partition(
    labels: np.ndarray,
    *,
    seed: int,
    clients: int,
    alpha: float,
    samples: int,
    min_samples: int,
    test_ratio: float,
) -> list[ClientPart]:
    """Every client's train, test and (FedFomo's) validation indices into the pooled dataset."""
    rng = np.random.default_rng(seed)
    subset = np.sort(rng.choice(len(labels), samples, replace=False))
    by_label = {int(k): subset[labels[subset] == k] for k in np.unique(labels[subset])}
    while True:
        dealt: list[list[int]] = [[] for _ in range(clients)]
        for label in sorted(by_label):
            indices = rng.permutation(by_label[label])
            shares = rng.dirichlet(np.repeat(alpha, clients))
            cuts = (np.cumsum(shares) * len(indices)).astype(int)[:-1]
            for client, part in enumerate(np.split(indices, cuts)):
                dealt[client].extend(part.tolist())
        if min(len(d) for d in dealt) >= min_samples:
            break
    parts = []
    for indices in dealt:
        indices = rng.permutation(np.asarray(indices, dtype=np.int64))
        n_test = int(len(indices) * test_ratio)
        train = indices[n_test:]
        shuffled = rng.permutation(train)
        parts.append(ClientPart(train=train, test=indices[:n_test], val=shuffled[: int(len(train) * VAL_RATIO)]))
    return parts


def write_parquet(parts: list[ClientPart], path: Path, with_val: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {
        "client_id": pa.array(range(len(parts)), pa.int64()),
        "train": pa.array(
            [np.setdiff1d(p.train, p.val).tolist() if with_val else p.train.tolist() for p in parts],
            pa.list_(pa.int64()),
        ),
        "test": pa.array([p.test.tolist() for p in parts], pa.list_(pa.int64())),
    }
    if with_val:
        columns["val"] = pa.array([p.val.tolist() for p in parts], pa.list_(pa.int64()))
    pq.write_table(pa.table(columns), path)


def write_flbench(parts: list[ClientPart], root: Path, setting: dict, idx_dir: Path | None = None) -> None:
    """FL-bench's data/fmnist/: partition.pkl and args.json as its generate_data.py writes them, raw files."""
    data = root / "data" / "fmnist"
    raw = data / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    clients = list(range(len(parts)))
    partition = {
        "separation": {"train": clients, "val": clients, "test": clients, "total": len(parts)},
        "data_indices": [
            {"train": p.train.astype(np.int64), "val": np.array([], np.int64), "test": p.test.astype(np.int64)}
            for p in parts
        ],
    }
    with open(data / "partition.pkl", "wb") as f:
        pickle.dump(partition, f)
    args = {
        "client_num": len(parts),
        "test_ratio": setting["test_ratio"],
        "val_ratio": 0.0,
        "seed": setting["seed"],
        "split": "sample",
        "IID_ratio": 0.0,
        "alpha": setting["alpha"],
        "monitor_window_name_suffix": f"fmnist-{len(parts)}clients-0%IID-Dir({setting['alpha']})",
    }
    (data / "args.json").write_text(json.dumps(args, indent=4))
    source = idx_dir or Path("/usr/share/datasets/fashion-mnist")
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        target = raw / stem
        if target.exists():
            continue
        if (source / stem).exists():
            shutil.copyfile(source / stem, target)
        else:  # torchvision reads the uncompressed files; the Debian package ships them gzipped
            with gzip.open(source / f"{stem}.gz", "rb") as fin, open(target, "wb") as fout:
                shutil.copyfileobj(fin, fout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for partition.parquet and partition_val.parquet"
    )
    parser.add_argument("--flbench", type=Path, help="an FL-bench checkout: write its data/fmnist/ files too")
    args = parser.parse_args()
    parts = dirichlet_partition(fashion_mnist_labels(), **SETTING)
    args.out.mkdir(parents=True, exist_ok=True)
    write_parquet(parts, args.out / "partition.parquet", with_val=False)
    write_parquet(parts, args.out / "partition_val.parquet", with_val=True)
    if args.flbench is not None:
        write_flbench(parts, args.flbench, SETTING)
    sizes = [len(p.train) + len(p.test) for p in parts]
    print(f"{len(parts)} clients, {sum(sizes)} samples, per client {min(sizes)}..{max(sizes)}")


if __name__ == "__main__":
    main()
