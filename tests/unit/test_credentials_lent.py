"""The tracking credentials stay in the process that writes to MLflow (issue 51, section 3): a local Ray's processes
are started `without_credentials`, and a sweep's trial holds the driver's only while it runs (`lent`). The processes
themselves: tests/system/test_run_identity.py."""

from __future__ import annotations

import os

from raysim.credentials import VARIABLES, connect_uri, held, lent, without_credentials


def test_a_ray_process_environment_has_no_credentials():
    environment = {
        "PATH": "/bin",
        "MLFLOW_TRACKING_USERNAME": "me",
        "MLFLOW_TRACKING_PASSWORD": "pw",
        "MLFLOW_TRACKING_TOKEN": "t",
        "MLFLOW_TRACKING_URI": "http://me:pw@host:5000",
    }
    assert without_credentials(environment) == {"PATH": "/bin", "MLFLOW_TRACKING_URI": "http://***@host:5000"}
    assert without_credentials({"MLFLOW_TRACKING_URI": "sqlite:///m.db"}) == {"MLFLOW_TRACKING_URI": "sqlite:///m.db"}


def test_lent_credentials_are_taken_back_whatever_the_trial_did(monkeypatch):
    for key in VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "the worker's own")
    with lent({"MLFLOW_TRACKING_USERNAME": "me", "MLFLOW_TRACKING_PASSWORD": "pw"}):
        assert held() == {
            "MLFLOW_TRACKING_USERNAME": "me",
            "MLFLOW_TRACKING_PASSWORD": "pw",
            "MLFLOW_TRACKING_TOKEN": "the worker's own",
        }
        assert connect_uri("http://other:secret@host:5000") == "http://host:5000"  # a trial's URI moves its own in
        assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "secret"
    assert held() == {"MLFLOW_TRACKING_TOKEN": "the worker's own"}
