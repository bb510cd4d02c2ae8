"""Small experiments for the tests: a tiny config, and a run through the CLI in the test process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NO_FIGURES = {"figures": [], "save_models": "none"}
"""tiny_config's tracking default: a run's two figures in three formats took 1-2.5 s of a tiny run's few seconds;
the tests of figures ask for them (tracking.figures), and the shipped configs' runs draw them. Nor are the final
models saved (tracking.save_models): tests/integration/test_saved_models.py asks for them."""
IN_PROCESS = {"actors": "in_process", "num_hosts": 2}
"""A runtime section whose hosts and coordinator run in the test's process (runtime.actors: in_process): the
integration tier's runs that are not about actors (tests/integration/test_matrix_on_ray.py shows they log on Ray
exactly what they log in process)."""
REUSED_ACTORS = {"num_hosts": 2, "reuse_actors": True}
"""tiny_config's runtime section unless a test gives its own: a run on the session's Ray takes the actors of the
one before (runtime.reuse_actors: a 3-round run took 7 s on new actors, 0.3 s on renewed ones;
tests/integration/test_crews.py shows renewed actors give a new crew's results)."""


def tiny_config(**sections: Any) -> dict[str, Any]:
    """A small, fast experiment (synthetic classification, MLR-sized model, no figures or saved models unless the
    tracking section names `figures` or `save_models`, actors reused unless a runtime section is given) as a raw
    config dict; keyword arguments replace or extend whole sections."""
    config: dict[str, Any] = {
        "algorithm": {"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32},
        "dataset": {"name": "synthetic_classification"},
        "partition": {"scheme": "dirichlet", "beta": 0.5},
        "model": {"name": "mlr"},
        "clients": {"count": 4},
        "rounds": 3,
        "seed": 7,
        "runtime": REUSED_ACTORS,
        "tracking": {"experiment": "tests", **NO_FIGURES},
    }
    for key, value in sections.items():
        config[key] = value
    config["tracking"] = {**NO_FIGURES, **config["tracking"]}
    return config


def run_through_cli(config: dict[str, Any] | Path, tracking_uri: str, *assignments: str) -> Any:
    """`raysim run CONFIG --quiet --set ...` in this process (a config dict is written next to the tracking
    store first); asserts exit 0 and returns the one MLflow run the store then holds."""
    import yaml
    from mlflow.tracking import MlflowClient

    from raysim.cli import main

    if isinstance(config, dict):
        path = Path(tracking_uri.removeprefix("sqlite:///")).parent / "experiment.yaml"
        path.write_text(yaml.safe_dump(config))
        config = path
    argv = ["run", str(config), "--quiet"]
    for assignment in assignments:
        argv += ["--set", assignment]
    assert main(argv) == 0
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return run
