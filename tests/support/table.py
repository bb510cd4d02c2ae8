"""What the table tests of several tiers share."""

from __future__ import annotations

import math

import numpy as np

ACCURACY = np.random.default_rng(0).uniform(0.3, 0.9, size=(5, 7))  # 5 runs x rounds 0..6
ACCURACY[0, 0] = 0.99  # round 0 (before training) above every trained round: not the max over rounds
ACCURACY[0, 5] = ACCURACY[0, 2] = 0.95  # a tie: the earliest round is the max's round
ACCURACY[4, 3] = math.nan  # a diverged round is passed over


TRAIN_LOSS = np.array(
    [
        [2.0, 1.2, 0.8, 0.45, 0.5, 0.3, 0.2],  # fedapm seed 1: <=0.5 first at round 3
        [2.0, 1.5, 1.0, 0.7, 0.5, 0.4, 0.35],  # fedapm seed 2: at round 4 (exactly 0.5)
        [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, math.nan],  # fedapm seed 3: never by its last round, 6
        [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4],  # fedavg seed 1: never
        [2.1, 2.0, 1.9, 1.8, 1.7, 1.6, 1.5],  # fedavg seed 2: never
    ]
)


HAND_RUNS = (("fedapm", 1), ("fedapm", 2), ("fedapm", 3), ("fedavg", 1), ("fedavg", 2))
