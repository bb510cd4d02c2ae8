"""The FLAME authors' q-label partition, as their code writes it (for comparisons with raysim's draw)."""

from __future__ import annotations

import math

import numpy as np


def their_q_label(labels, num_users, q):
    num_labels = len(np.unique(labels))
    num_shards = math.ceil(q * num_users / num_labels)
    indices = [np.where(labels == i)[0] for i in range(num_labels)]
    data_split_indices = []
    for i in range(num_labels):
        data_split_indices.extend(np.array_split(indices[i], num_shards))
    user_data_indices = {}
    for user_id in range(num_users):
        np.random.shuffle(data_split_indices)
        user_data_indices[user_id] = np.concatenate(data_split_indices[:q])
        del data_split_indices[:q]
    return user_data_indices
