"""Data: sources (whole datasets as numpy arrays) and partitions (who holds which samples)."""

from raysim.data.partitions import ClientSplit, PartitionSettings, partition_dataset
from raysim.data.sources import Dataset, load_dataset
from raysim.errors import DataError, PartitionError

__all__ = [
    "ClientSplit",
    "DataError",
    "Dataset",
    "PartitionError",
    "PartitionSettings",
    "load_dataset",
    "partition_dataset",
]
