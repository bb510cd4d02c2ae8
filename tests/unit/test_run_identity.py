"""What the MLflow UI shows about a run before its metrics: the experiment opens as model training, the run has a
name that says what ran, MLflow's standard tags, a description, and its dataset as an input with the partition's
digest; options left unset are not logged as "None". Checked on the shipped quickstart, run as a user runs it."""

from __future__ import annotations


def test_the_partition_digest_changes_with_the_partition_and_only_with_it():
    import numpy as np

    from raysim.data.partitions import ClientSplit
    from raysim.tracking.identity import partition_digest

    labels = np.arange(10) % 3
    split = [ClientSplit(0, np.array([0, 1]), np.array([2]), np.array([], np.int64))]
    again = [ClientSplit(0, np.array([0, 1]), np.array([2]), np.array([], np.int64))]
    moved = [ClientSplit(0, np.array([0]), np.array([1, 2]), np.array([], np.int64))]
    assert partition_digest(labels, split) == partition_digest(labels, again)
    assert partition_digest(labels, split) != partition_digest(labels, moved)
    assert partition_digest(labels, split) != partition_digest(labels[::-1].copy(), split)
