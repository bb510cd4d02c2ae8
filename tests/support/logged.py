"""What a finished run must have logged, read back from its MLflow store (docs/usage.md, "What is logged")."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

EVALUATED = (
    "acc",
    "loss",
    "train_loss",
    "loss_var",
    "acc_var",
    "acc_std",
    "loss_std",
    "acc_min",
    "acc_p10",
    "lagging_share",
    "loss_sum_var",
)
"""Per evaluation, for pm, gm, hm (and hm_val with a validation split, and heldout/... with held-out clients)."""
PER_ROUND = (
    "time/clients",
    "time/aggregation",
    "time/round",
    "traffic/uplink_bytes",
    "traffic/downlink_bytes",
    "traffic/uplink_bytes_total",
    "traffic/downlink_bytes_total",
)
AT_THE_END = ("pm/best_acc", "gm/best_acc", "hm/best_acc")
DEVIATION = (
    "update/deviation",
    "update/deviation_l2",
    "update/deviation_std",
    "update/deviation_l2_std",
    "update/deviation_max",
    "update/deviation_l2_max",
)
"""Per round, for the methods of FedAPM's Table 3: ||u_i - u|| over the shared tensors (docs/algorithms.md)."""
DEVIATION_ALGORITHMS = ("fedapm", "fedalt", "fedsim", "fedavg", "fedprox")
SYSTEM = "system/"
"""MLflow's system metrics (tracking.system_metrics): sampled every 10 s, their steps count samples, not rounds."""


def evaluated_steps(config: Mapping[str, Any]) -> set[int]:
    """0 (before training), every tracking.eval_every-th round and the last."""
    rounds, every = config["rounds"], config["tracking"].get("eval_every", 1)
    return {0, rounds} | set(range(every, rounds + 1, every))


def expected_keys(config: Mapping[str, Any], step: int) -> set[str]:
    """The metric keys the docs promise at `step` of a run of `config` (a raw config tree, defaults filled)."""
    keys: set[str] = set()
    if step in evaluated_steps(config):
        models = ["pm", "gm", "hm", *(["hm_val"] if config["partition"].get("val_fraction") else [])]
        if config["clients"].get("heldout"):
            models += [f"heldout/{model}" for model in models]
        scored = EVALUATED if config["tracking"].get("train_loss", True) is True else set(EVALUATED) - {"train_loss"}
        keys |= {f"{model}/{name}" for model in models for name in scored} | {"hm/pm_chosen_share"}
    if step > 0:
        keys |= set(PER_ROUND) | ({"time/evaluation"} if step in evaluated_steps(config) else set())
        if config["algorithm"]["name"] in DEVIATION_ALGORITHMS:
            keys |= set(DEVIATION)
    if step == config["rounds"]:
        keys |= set(AT_THE_END)
    return keys


def check_logged(client: MlflowClient, run_id: str, config: Mapping[str, Any]) -> Run:
    """The run FINISHED; every metric it logged is finite and logged at most once per step; every step 0..rounds
    has the documented keys, and no metric but the system metrics is logged at another step. Returns the run (as
    read for the check: a caller need not ask the store again)."""
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED", run.data.tags.get("raysim.error")
    logged = run_points(client, run_id)
    check_points({key: logged.get(key, []) for key in run.data.metrics}, config)
    return run


def run_points(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric point of one run, key -> (step, value) in the order of `get_metric_history` (timestamp, step,
    value), NaN as MLflow returns it: from a sqlite store in one query, where MLflow asks once per key (a quarter
    of a matrix cell's time went to its 68 requests); through the client from any other store."""

    if not client.tracking_uri.startswith("sqlite:///"):
        keys = client.get_run(run_id).data.metrics
        return {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in keys}
    return _sqlite_points(client.tracking_uri, "timestamp, step, value", run_id).get(run_id, {})


def check_points(history: Mapping[str, list[tuple[int, float]]], config: Mapping[str, Any]) -> None:
    """check_logged on a run's points (metric key -> (step, value) pairs, as `points` reads them)."""
    at_step: dict[int, set[str]] = {}
    for key, logged in history.items():
        steps = [step for step, _ in logged]
        assert len(steps) == len(set(steps)), f"{key} logged more than once at a step: {sorted(steps)}"
        bad = [(step, value) for step, value in logged if not math.isfinite(value)]
        assert not bad, f"{key} is not finite at (step, value) {bad}"
        if key.startswith(SYSTEM):
            continue
        for step in steps:
            at_step.setdefault(step, set()).add(key)
    assert sorted(at_step) == list(range(config["rounds"] + 1))
    for step, keys in at_step.items():
        missing = expected_keys(config, step) - keys
        assert not missing, f"step {step} lacks {sorted(missing)}"


def points(uri: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Every metric point of a sqlite store in one query, run id -> key -> (step, value) in step order: reading
    the metric histories through MLflow takes one request per run and key (about a second for a run's 40 keys)."""
    assert uri.startswith("sqlite:///"), uri
    return _sqlite_points(uri, "step, timestamp")


def _sqlite_points(uri: str, order: str, run_id: str | None = None) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """A sqlite store's metric points in one query (one run's with `run_id`), run id -> key -> (step, value) in
    `order` (SQL), NaN as MLflow returns it."""
    import sqlite3

    where, arguments = ("WHERE run_uuid = ?", (run_id,)) if run_id is not None else ("", ())
    found: dict[str, dict[str, list[tuple[int, float]]]] = {}
    with contextlib.closing(sqlite3.connect(uri.removeprefix("sqlite:///"))) as db:
        rows = db.execute(f"SELECT run_uuid, key, step, value, is_nan FROM metrics {where} ORDER BY {order}", arguments)
        for run, key, step, value, is_nan in rows:
            found.setdefault(run, {}).setdefault(key, []).append((step, math.nan if is_nan else value))
    return found
