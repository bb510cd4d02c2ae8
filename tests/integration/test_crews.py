"""runtime.reuse_actors (raysim.runtime.crews): a finished run's actors serve the next run of the process, which
then gives exactly the results new actors give, whatever ran on them before; a crew that lost an actor, or a
failed run's, is never reused."""

from __future__ import annotations

import threading

import pytest
import ray

from raysim.config import validate_config
from raysim.errors import RaysimError
from raysim.runtime import crews
from raysim.runtime.driver import run_experiment
from tests.support.experiments import tiny_config
from tests.support.stores import fresh_store

pytestmark = pytest.mark.slow


def _config(tmp_path, reuse: bool, num_hosts: int = 2, **sections):
    tracking = {"experiment": "crews", "uri": fresh_store(tmp_path / "mlflow.db")}
    runtime = {"num_hosts": num_hosts, "reuse_actors": reuse}
    return validate_config(tiny_config(rounds=2, runtime=runtime, tracking=tracking, **sections))


def _scores(config) -> dict[int, dict[str, float]]:
    """Every logged metric but timings (which differ run to run)."""
    history = run_experiment(config, show_progress=False).history
    return {step: {k: v for k, v in row.items() if not k.startswith("time/")} for step, row in history.items()}


def _parked_actor_ids() -> list[str]:
    return sorted(
        actor._actor_id.hex()
        for parked in crews._parked.values()
        for crew in parked
        for actor in [*crew.hosts, crew.coordinator]
    )


@pytest.fixture
def empty_crews(ray_local):
    crews.dismiss_parked()
    yield
    crews.dismiss_parked()


def test_renewed_actors_give_a_new_crews_results_after_another_algorithm_ran_on_them(tmp_path, empty_crews):
    flame = _scores(_config(tmp_path, reuse=False))
    assert not crews._parked  # off: nothing kept
    ditto = {"name": "ditto", "lambda": 0.5, "lr": 0.05, "batch_size": 32}
    _scores(_config(tmp_path, reuse=True, algorithm=ditto))
    first = _parked_actor_ids()
    assert len(first) == 3  # two hosts and the coordinator
    assert _scores(_config(tmp_path, reuse=True)) == flame
    assert _parked_actor_ids() == first  # the same actors ran it


def test_a_crew_that_lost_an_actor_is_replaced_and_a_failed_runs_crew_is_not_kept(tmp_path, empty_crews):
    flame = _scores(_config(tmp_path, reuse=True))
    (key,) = crews._parked
    (crew,) = crews._parked[key]
    lost = crew.hosts[1]._actor_id.hex()
    ray.kill(crew.hosts[1])
    assert _scores(_config(tmp_path, reuse=True)) == flame
    assert lost not in _parked_actor_ids() and len(_parked_actor_ids()) == 3
    diverging = _config(tmp_path, reuse=True, algorithm={"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 1e30})
    with pytest.raises(RaysimError):
        run_experiment(diverging, show_progress=False)
    assert _parked_actor_ids() == []


def test_a_run_needing_other_resources_ends_the_parked_crew_instead_of_waiting_for_its_cpus(tmp_path, empty_crews):
    """The session's Ray has 2 CPUs: a parked one-host crew holds one, a two-host run needs both."""
    run_experiment(_config(tmp_path, reuse=True, num_hosts=1), show_progress=False)
    assert len(_parked_actor_ids()) == 2
    run_experiment(_config(tmp_path, reuse=True), show_progress=False)
    assert len(_parked_actor_ids()) == 3  # only the two-host crew is left


def test_a_sweep_ends_the_parked_crews_before_and_after_its_trials(tmp_path, empty_crews):
    """A sweep's trials are Ray tasks, other processes: their runs cannot take this process's parked crew, and
    waited for its CPUs for ever (a notebook that ran raysim.api.run with reuse_actors, then a sweep); a trial that
    kept its own crew in its idle worker process made this process's next run wait for ever likewise."""
    from raysim.studies.sweep import parse_sweep, run_sweep

    run_experiment(_config(tmp_path, reuse=True), show_progress=False)
    assert len(_parked_actor_ids()) == 3  # both CPUs of the session's Ray
    base = tiny_config(rounds=1, tracking={"experiment": "crews", "uri": fresh_store(tmp_path / "mlflow.db")})
    sweep = parse_sweep({"name": "after-a-parked-crew", "base": base, "grid": {"algorithm.lr": [0.05]}})
    done: list = []
    thread = threading.Thread(target=lambda: done.append(run_sweep(sweep, show_progress=False)), daemon=True)
    thread.start()
    thread.join(timeout=180)
    assert done and [o.status for o in done[0].outcomes] == ["finished"], "the trial waited for the parked crew"
    after: list = []
    thread = threading.Thread(target=lambda: after.append(_scores(_config(tmp_path, reuse=True))), daemon=True)
    thread.start()
    thread.join(timeout=180)
    assert after, "the run after the sweep waited for the crew its trial kept"
