"""docker/: what can be checked without a Docker engine (`make test-images`, tests/system/check_images.py, builds
and runs the images where one is).

The compose files parse (with `docker compose config` and Debian's docker-compose 1.29 where installed, else as YAML
with the services, health checks and volumes the README promises); the images pin the versions that
constraints.txt pins; the files the images copy and the job entrypoints exist.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.support.paths import ROOT

DOCKER = ROOT / "docker"


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_ray_images_pin_the_constraints_versions(name):
    text = (DOCKER / name).read_text()
    pins = constraints()
    base = re.search(r"^ARG BASE_IMAGE=rayproject/ray:([\d.]+)-py(\d)(\d+)-", text, re.MULTILINE)
    assert base, f"{name}: no pinned rayproject/ray default base image"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.MULTILINE), f"{name}: the base is the BASE_IMAGE argument"
    assert base.group(1) == pins["ray"]
    pinned = dict(re.findall(r'"([a-z\[\]]+)==([\d.]+)"', text))
    assert pinned["torch"] == pins["torch"]
    assert pinned["ray[default]"] == pins["ray"]
    assert "-c constraints.txt" in text
    assert " -e ." not in text, f"{name}: raysim is installed as a package, not editable"
    assert "python -m raysim.data.fetch" in text, f"{name}: Fashion-MNIST is baked into the image"
    for source in re.findall(r"^COPY --chown=\S+ (.+) \S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"{name} copies {path}, which does not exist"


def test_python_of_the_images_is_one_the_project_supports():
    major, minor = re.search(r"py(\d)(\d+)-", (DOCKER / "Dockerfile").read_text()).groups()
    floor = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text()).groups()
    assert (int(major), int(minor)) >= (int(floor[0]), int(floor[1]))
    assert f"ARG BASE_IMAGE=python:{major}.{minor}" in (DOCKER / "Dockerfile.mlflow").read_text()


def test_mlflow_image_pins_the_constraints_mlflow():
    pinned = dict(re.findall(r'"([a-z0-9\[\]-]+)==([\d.]+)"', (DOCKER / "Dockerfile.mlflow").read_text()))
    assert pinned["mlflow"] == constraints()["mlflow"]
    assert pinned["psycopg[binary]"] == constraints()["psycopg"], "the driver SQLAlchemy 2.1 takes for postgresql://"


def test_compose_has_head_workers_mlflow_on_postgres_with_health_checks():
    services = compose()["services"]
    assert set(services) == {"ray-head", "ray-worker", "mlflow", "postgres"}
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
    assert "--head" in services["ray-head"]["command"]
    assert "ray-head:6379" in services["ray-worker"]["command"]
    assert "replicas" in services["ray-worker"]["deploy"]
    assert "postgresql://" in services["mlflow"]["command"]
    assert "mlartifacts:/mlartifacts" in services["mlflow"]["volumes"]
    assert set(compose()["volumes"]) == {"pgdata", "mlartifacts"}
    assert services["ray-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert services["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for service in services.values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), "published ports stay on 127.0.0.1"
        build = service.get("build")
        if build:
            assert (DOCKER / build["context"] / build["dockerfile"]).is_file()
    assert services["ray-head"]["environment"]["RAY_AUTH_MODE"] == "token"


def test_job_entrypoints_exist():
    for kind in ("experiment", "sweep"):
        text = (ROOT / "jobs" / f"{kind}.py").read_text()
        assert f'entrypoint("{kind}")' in text


def _compose_clis() -> list[list[str]]:
    """Compose v2 (the docker CLI's plugin) and Debian's docker-compose 1.29, whichever are installed."""
    found = []
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        found.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    return found


@pytest.mark.skipif(not _compose_clis(), reason="neither Compose v2 nor docker-compose is installed here")
@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose.offline.yaml"]])
def test_docker_compose_config_accepts_the_file(files):
    for cli in _compose_clis():
        result = subprocess.run(
            [*cli, "-p", "raysim", *(word for name in files for word in ("-f", str(DOCKER / name))), "config", "-q"],
            capture_output=True,
            text=True,
            env={"RAY_AUTH_TOKEN": "x", "PATH": "/usr/bin:/bin:/usr/local/bin"},
        )
        assert result.returncode == 0, (cli, result.stderr)


def test_compose_works_with_compose_1_29_and_the_offline_file_only_swaps_bases():
    """docker-compose 1.29 (Debian's) refuses a top-level `name:`; the offline file changes the builds' bases and
    PostgreSQL's image, nothing else."""
    assert "name" not in compose()
    offline = yaml.safe_load((DOCKER / "compose.offline.yaml").read_text())["services"]
    assert set(offline) <= set(compose()["services"])
    for name, service in offline.items():
        assert set(service) <= {"build", "image"}, name
        assert service["build"]["args"]["BASE_IMAGE"] == "raysim-base:bookworm", name
        if "dockerfile" in service["build"]:
            assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    assert offline["postgres"]["build"]["dockerfile"] == "docker/Dockerfile.postgres"


def test_dockerignore_keeps_stores_out_and_what_the_images_copy_in():
    patterns = [
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".venv", ".git", "mlruns", "mlflow.db"} <= set(patterns)
    copied = set()
    for dockerfile in DOCKER.glob("Dockerfile*"):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY") and "--from" not in line:
                copied.update(part for part in line.split()[1:-1] if not part.startswith("--"))
    assert {"raysim", "configs", "pyproject.toml"} <= copied
    for source in copied:
        assert not any(source == p or source.startswith(p + "/") for p in patterns), source
