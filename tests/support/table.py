"""A suite written by hand into a sqlite store, with known curves, for the tests of `raysim table` and figures."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from tests.support.stores import fresh_store

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


def write_hand_suite(folder: Path) -> tuple[str, str]:
    """A sqlite store in `folder` with a suite's parent and five finished children (plus one failed, left out)
    written through the MLflow client, each with the curves ACCURACY and TRAIN_LOSS at steps 0..6; (tracking URI,
    parent run id)."""
    from mlflow.entities import Metric, Param

    uri = fresh_store(folder / "mlflow.db")
    client = MlflowClient(uri)
    experiment = client.create_experiment("hand")
    parent = client.create_run(experiment, run_name="hand", tags={"suite": "hand"}).info.run_id
    for index, (name, seed) in enumerate([*HAND_RUNS, ("fedavg", 3)]):
        run = client.create_run(experiment, run_name=f"{name}/seed{seed}", tags={"mlflow.parentRunId": parent})
        curves = {"pm/acc": ACCURACY[index % 5], "pm/train_loss": TRAIN_LOSS[index % 5]}
        metrics = [
            Metric(key, float(value), 0, step) for key, curve in curves.items() for step, value in enumerate(curve)
        ]
        client.log_batch(run.info.run_id, metrics=metrics, params=[Param("seed", str(seed))])
        client.set_terminated(run.info.run_id, "FAILED" if index == 5 else "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return uri, parent
