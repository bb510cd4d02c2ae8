"""Data: dataset sources (whole datasets as numpy arrays, chosen by `dataset.name`) and partition schemes (who holds
which samples, chosen by `partition.scheme`). The built-in modules are imported here so that they register
(raysim.data.dataset.DATASETS, raysim.data.scheme.PARTITIONS), in the order the listings show them."""

# isort: off
from raysim.data import fashion_mnist, idx, leaf, cifar, medmnist, image_folder, huggingface, substitutes  # noqa: F401
from raysim.data import fedmultimodal  # noqa: F401
from raysim.data import sources, partitions, meta_partition, partition_file  # noqa: F401

# isort: on
from raysim.data.dataset import DATASETS, Dataset, DatasetSettings
from raysim.data.partitions import partition_dataset
from raysim.data.scheme import PARTITIONS, ClientSplit, SchemeSettings
from raysim.data.sources import load_dataset
from raysim.errors import DataError, PartitionError

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "ClientSplit",
    "DataError",
    "Dataset",
    "DatasetSettings",
    "PartitionError",
    "SchemeSettings",
    "load_dataset",
    "partition_dataset",
]
