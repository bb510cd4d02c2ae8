"""The matrix's cells on real Ray hosts: a sample in which every algorithm, executor and scheme runs at least once
(tests/support/matrix.py RAY_SAMPLE) runs through Ray actors, on the session's local Ray and the actors of the cell
before (runtime.reuse_actors), and must log exactly what the same cell logs in process (runtime.actors:
in_process, as every cell runs in tests/integration/test_matrix.py): every metric at every step, bit for bit, but
the timings. The in-process run is the one test_matrix.py logged where this worker ran that cell already."""

from __future__ import annotations

from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from tests.support.logged import check_logged, run_points
from tests.support.matrix import RAY_SAMPLE, experiment

pytestmark = pytest.mark.xdist_group("integration-matrix_on_ray")
"""One worker runs the sample back to back, so that every cell after the first takes the crew of the cell before
(runtime.reuse_actors): spread over both workers, between other modules' tests, each return to this module started
a new crew (tests/conftest.py no_crew_left dismisses a module's parked actors), about 4.5 CPU-s each time."""


def timed(key: str) -> bool:
    """A metric that measures the machine, not the run: time/*, system/*, a server step's own seconds."""
    return key.startswith(("time/", "system/")) or (key.startswith("server/") and key.endswith("_seconds"))


def logged(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric's history but the timings, as (step, value) pairs."""
    points = run_points(client, run_id)
    keys = [key for key in client.get_run(run_id).data.metrics if not timed(key)]
    return {key: sorted(points.get(key, [])) for key in keys}


@pytest.mark.matrix
@pytest.mark.parametrize("cell", RAY_SAMPLE, ids=lambda cell: cell.name)
def test_a_cell_on_ray_hosts_logs_what_it_logs_in_process(cell, contexts, matrix_store, ray_local, pretrained_cache):
    client = MlflowClient(matrix_store)
    on_ray = experiment(cell, contexts[cell.val], matrix_store, actors="ray")
    ray_run = run_experiment(validate_config(on_ray), show_progress=False).run_id
    check_logged(client, ray_run, on_ray)
    in_process = experiment(cell, contexts[cell.val], matrix_store, actors="in_process")
    local_run = finished_run(client, in_process) or run_experiment(validate_config(in_process), False).run_id
    assert logged(client, ray_run) == logged(client, local_run)


def finished_run(client: MlflowClient, config: dict[str, Any]) -> str | None:
    """The id of a FINISHED run of `config` in the store, if the session ran it already: the same cell of
    tests/integration/test_matrix.py, run in process on this worker's matrix store under the same name (the same
    config, so the same run: it is not run twice)."""
    found = client.get_experiment_by_name(config["tracking"]["experiment"])
    if found is None:
        return None
    name = config["tracking"]["run_name"]
    runs = client.search_runs(
        [found.experiment_id], f"attributes.run_name = '{name}' and attributes.status = 'FINISHED'"
    )
    return runs[0].info.run_id if runs else None
