"""The docker images built and run (issue 50.1), `make test-images`: the Debian base from Debian's packages
(docker/debian-base.sh), raysim, MLflow and PostgreSQL on it (docker/build.sh, the torch wheel from this machine's
pip configuration), then the quickstart in a raysim container against the MLflow server and PostgreSQL that
docker/compose.yaml (+ compose.offline.yaml) starts, read back from both.

Named check_*.py, not test_*.py, so that `make test` (pytest's default collection) leaves it out: it needs a Docker
engine and root, and takes minutes of building; `make test-images` names the file. It prints what the closing note
of issue 50 reports (build times, image sizes, the quickstart's time and last line). DOCKER picks the docker CLI
(it must build with BuildKit); the compose CLI is `docker compose` where that plugin exists, else docker-compose.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

from tests.support.cluster import free_port
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(3600)

DOCKER = os.environ.get("DOCKER", "docker")
BASE = "raysim-base:bookworm"
IMAGES = {"raysim": "raysim:0.1.0", "mlflow": "raysim-mlflow:3.17.2", "postgres": "raysim-postgres:15"}
COMPOSE_FILES = ["docker/compose.yaml", "docker/compose.offline.yaml"]
REPORT: list[str] = []
"""Lines printed at the end of the module (pytest -s): what the closing note reports."""


def run(
    command: list[str], timeout: float = 1800, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """A command that must succeed; its output in the failure message."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, (
        f"{shlex.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


def timed(
    command: list[str], timeout: float = 1800, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = run(command, timeout, env)
    return done, time.monotonic() - start


def size_mb(image: str) -> float:
    return int(run([DOCKER, "image", "inspect", "--format", "{{.Size}}", image]).stdout) / 1e6


def compose_cli() -> list[str]:
    if subprocess.run([DOCKER, "compose", "version"], capture_output=True).returncode == 0:
        return [DOCKER, "compose"]
    assert shutil.which("docker-compose"), "neither `docker compose` nor docker-compose is installed"
    return ["docker-compose"]


@pytest.fixture(scope="module")
def images() -> Iterator[dict[str, str]]:
    """The base (built when missing or RAYSIM_REBUILD_BASE=1: a new base invalidates every later layer's cache),
    then the three images on it."""
    assert run([DOCKER, "info", "--format", "{{.ServerVersion}}"]).stdout.strip(), "no Docker engine"
    present = subprocess.run([DOCKER, "image", "inspect", BASE], capture_output=True).returncode == 0
    if not present or os.environ.get("RAYSIM_REBUILD_BASE") == "1":
        _, seconds = timed(["docker/debian-base.sh"], env={**os.environ, "DOCKER": DOCKER})
        REPORT.append(f"debian-base.sh: {BASE} in {seconds:.0f} s")
    done, seconds = timed(["docker/build.sh", "--base", BASE], env={**os.environ, "DOCKER": DOCKER})
    REPORT.append(f"build.sh --base {BASE}: three images in {seconds:.0f} s")
    REPORT.extend(line for line in done.stdout.splitlines() if line.startswith("build.sh:"))
    for image in [BASE, *IMAGES.values()]:
        REPORT.append(f"image {image}: {size_mb(image):.0f} MB")
    yield IMAGES
    print("\n" + "\n".join(f"[test-images] {line}" for line in REPORT))


def test_the_raysim_image_runs_offline_with_the_pinned_cpu_stack_and_the_data(images):
    probe = (
        "import json, os, ray, torch, torchvision, raysim;"
        "from raysim.data.fashion_mnist import load_fashion_mnist;"
        "images, labels = load_fashion_mnist(download=False);"
        "print(json.dumps({'ray': ray.__version__, 'torch': torch.__version__, 'cuda': torch.version.cuda,"
        " 'torchvision': torchvision.__version__, 'user': os.getuid(), 'images': len(labels),"
        " 'raysim': os.path.dirname(raysim.__file__)}))"
    )
    done = run([DOCKER, "run", "--rm", "--network", "none", images["raysim"], "python", "-c", probe])
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["ray"] == "2.60.0" and found["torch"].startswith("2.13.0") and found["cuda"] is None, found
    assert found["torchvision"].startswith("0.28.0") and found["user"] == 1000 and found["images"] == 70000, found
    assert "site-packages" in found["raysim"], f"raysim is installed as a package, not {found['raysim']}"
    REPORT.append(f"raysim image, no network: {found}")


def test_the_compose_files_pass_compose_config(images):
    env = {**os.environ, "RAY_AUTH_TOKEN": "x"}
    files = [word for path in COMPOSE_FILES for word in ("-f", path)]
    for cli in {tuple(compose_cli()), *([("docker-compose",)] if shutil.which("docker-compose") else [])}:
        run([*cli, "-p", "raysim-config", *files, "config", "-q"], env=env)
        run([*cli, "-p", "raysim-config", "-f", COMPOSE_FILES[0], "config", "-q"], env=env)
        REPORT.append(f"{' '.join(cli)} config: compose.yaml and + compose.offline.yaml accepted")


def test_the_quickstart_runs_in_a_container_against_mlflow_on_postgresql_from_compose(images):
    project = f"raysim-check-{os.getpid()}"
    port = free_port()
    env = {**os.environ, "RAY_AUTH_TOKEN": secrets.token_hex(16), "MLFLOW_PORT": str(port)}
    env["RAY_DASHBOARD_PORT"] = str(free_port())
    compose = [*compose_cli(), "-p", project, *(word for path in COMPOSE_FILES for word in ("-f", path))]
    try:
        _, up = timed([*compose, "up", "-d", "--no-build", "mlflow"], env=env, timeout=600)
        mlflow_container = run([*compose, "ps", "-q", "mlflow"], env=env).stdout.strip()
        deadline = time.monotonic() + 180
        while run([DOCKER, "inspect", "--format", "{{.State.Health.Status}}", mlflow_container]).stdout.strip() != (
            "healthy"
        ):
            assert time.monotonic() < deadline, run([*compose, "logs", "mlflow"], env=env).stdout[-3000:]
            time.sleep(2)
        REPORT.append(
            f"compose up postgres + mlflow: {up:.0f} s, mlflow healthy {time.monotonic() - deadline + 180:.0f} s later"
        )
        done, seconds = timed(
            [*compose, "run", "--rm", "-T", "ray-head", "raysim", "run", "configs/quickstart.yaml"], env=env
        )
        last = done.stdout.strip().splitlines()[-1]
        REPORT.append(f"quickstart in a raysim container: {seconds:.0f} s; last line: {last}")

        # the run, read back through the published MLflow port and straight from PostgreSQL
        base = f"http://127.0.0.1:{port}/api/2.0/mlflow"
        query = urllib.parse.urlencode({"experiment_name": "quickstart"})
        with urllib.request.urlopen(f"{base}/experiments/get-by-name?{query}", timeout=30) as answer:
            experiment = json.load(answer)["experiment"]["experiment_id"]
        request = urllib.request.Request(
            f"{base}/runs/search",
            data=json.dumps({"experiment_ids": [experiment]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            (found,) = json.load(answer)["runs"]
        assert found["info"]["status"] == "FINISHED", found["info"]
        metrics = {metric["key"]: metric for metric in found["data"]["metrics"]}
        accuracy = next(key for key in metrics if "acc" in key)
        assert metrics[accuracy]["step"] == 40, metrics[accuracy]  # step 0 before training, then rounds 1..40
        sql = "SELECT count(*) FROM runs r JOIN metrics m ON m.run_uuid = r.run_uuid WHERE r.status = 'FINISHED'"
        rows = run([*compose, "exec", "-T", "postgres", "psql", "-U", "mlflow", "-d", "mlflow", "-tAc", sql], env=env)
        assert int(rows.stdout.strip()) >= 41, rows.stdout
        REPORT.append(
            f"MLflow on PostgreSQL: run {found['info']['run_id']} FINISHED, {accuracy} = "
            f"{metrics[accuracy]['value']:.4f} at step {metrics[accuracy]['step']}, {rows.stdout.strip()} metric rows"
        )
    finally:
        subprocess.run([*compose, "down", "-v", "--remove-orphans"], cwd=ROOT, env=env, capture_output=True)
