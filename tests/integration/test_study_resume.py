"""A stopped suite resumes: `raysim run SUITE.yaml --resume PARENT_RUN` keeps finished children, continues the
interrupted one from its checkpoint in the same MLflow run, starts the missing ones, and never duplicates one."""

from __future__ import annotations

import pytest

from raysim.cli import main
from raysim.errors import ConfigError
from raysim.studies.resume import reopen_parent
from raysim.tracking.mlflow_writer import MlflowWriter
from tests.support.stores import fresh_store
from tests.support.studies import resumable_suite


@pytest.mark.slow
def test_resume_refuses_a_run_that_is_not_this_suites_parent(tmp_path):
    uri = fresh_store(tmp_path / "mlflow.db")
    writer = MlflowWriter(uri, "resume")
    other = writer.start("other", {}, {"suite": "other"})
    single = writer.start("single", {}, {})
    writer.finish()
    for run, message in (
        (other, "parent run of the suite 'other', not of the suite 'stopped'"),
        (single, "parent run of no study"),
        ("0" * 32, "no such run"),
    ):
        with pytest.raises(ConfigError, match=message):
            reopen_parent(MlflowWriter(uri, "resume"), run, "suite", "stopped")
    path = resumable_suite(tmp_path, uri)
    assert main(["run", str(path), "--quiet", "--resume", other]) == 2
