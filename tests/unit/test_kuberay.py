"""deploy/kuberay/ as files (no Kubernetes cluster is available here): the RayCluster and RayJob against KubeRay's
CRD schemas (tests/support/kuberay.py: the parts they use, cut from KubeRay v1.7.0) and the operator's own checks
(ray-operator/controllers/ray/utils/validation.go), and against docker/: the same image and Ray, the same ports,
`ray start` resources, shared memory and environment names, and a RayJob entrypoint that raysim runs. The commands
docs/cluster.md shows must name the files, Secrets, keys, service and ports the manifests use."""

from __future__ import annotations

import copy
import json
import re
import shlex
from typing import Any

import jsonschema
import pytest
import yaml

from raysim.cli import parser
from raysim.config import load_config
from raysim.credentials import VARIABLES
from tests.support.kuberay import DEPLOY, documents, load_subset, manifests, unchecked
from tests.support.paths import ROOT

CLUSTER = documents(DEPLOY / "raycluster.yaml")[0]
JOB = documents(DEPLOY / "rayjob.yaml")[0]
MLFLOW = {document["kind"]: document for document in documents(DEPLOY / "mlflow.yaml")}
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
KNOWN_KINDS = {
    ("ray.io/v1", "RayCluster"),
    ("ray.io/v1", "RayJob"),
    ("v1", "PersistentVolumeClaim"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
}
TOKEN_ENV = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
"""What KubeRay puts in every Ray container, the submitter's and its own dashboard client when authOptions.mode is
`token` (SetContainerTokenAuthEnvVars, controllers/ray/common/pod.go), RAY_AUTH_TOKEN from the Secret's TOKEN_KEY."""
TOKEN_KEY = "auth_token"
"""RAY_AUTH_TOKEN_SECRET_KEY of KubeRay (controllers/ray/utils/constant.go)."""
RAY_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
"""The head container's ports by the names KubeRay looks them up by; 10001 is `ray start --head`'s
--ray-client-server-port when none is given (ray/scripts/scripts.py), as in compose."""
MAX_CLUSTER_NAME, MAX_JOB_NAME = 53, 47
"""MaxRayClusterNameLength and MaxRayJobNameLength (controllers/ray/utils/constant.go)."""
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def cluster_specs() -> list[tuple[str, dict[str, Any]]]:
    return [("raycluster.yaml", CLUSTER["spec"]), ("rayjob.yaml", JOB["spec"]["rayClusterSpec"])]


def groups(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The head group and every worker group of a RayCluster spec."""
    return [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]


def ray_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The Ray container of each group: the first (utils.RayContainerIndex)."""
    return [group["template"]["spec"]["containers"][0] for group in groups(spec)]


def compose_flags(command: str) -> dict[str, Any]:
    """The flags of a compose command (`ray start`, `mlflow server`): --flag VALUE as a string, a bare flag as True."""
    words = shlex.split(command)
    flags: dict[str, Any] = {}
    for index, word in enumerate(words):
        if word.startswith("--"):
            following = words[index + 1] if index + 1 < len(words) else "--"
            flags[word[2:]] = True if following.startswith("--") else following
    return flags


def start_param(value: str) -> str:
    """What `ray start` receives for a rayStartParams value: KubeRay writes `--KEY=VALUE` into the container's bash
    command (convertParamMap, controllers/ray/common/pod.go), so the value goes through the shell once."""
    (word,) = shlex.split(value)
    return word


def quantity_bytes(text: str) -> int:
    """A Kubernetes quantity (2Gi) or a compose size (2gb: binary units, docker's RAMInBytes) in bytes."""
    number, unit = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", text).groups()
    scale = {"": 1, "k": 1024, "kb": 1024, "ki": 1024, "m": 1024**2, "mb": 1024**2, "mi": 1024**2}
    scale |= {"g": 1024**3, "gb": 1024**3, "gi": 1024**3}
    return int(number) * scale[unit.lower()]


def operator_errors(kind: str, document: dict[str, Any]) -> list[str]:
    """KubeRay v1.7.0's own checks (controllers/ray/utils/validation.go) of what the manifests use, one line each."""
    errors = []
    name, limit = document["metadata"]["name"], MAX_CLUSTER_NAME if kind == "RayCluster" else MAX_JOB_NAME
    if len(name) > limit or not DNS1035.match(name):
        errors.append(f"{kind} name {name!r}: a DNS-1035 label of at most {limit} characters")
    spec = document["spec"]
    if kind == "RayJob":
        if spec.get("rayClusterSpec") is None and not spec.get("clusterSelector"):
            errors.append("one of RayClusterSpec or ClusterSelector must be set")
        if spec.get("ttlSecondsAfterFinished", 0) < 0:
            errors.append("TTLSecondsAfterFinished must be a non-negative integer")
        if not spec.get("shutdownAfterJobFinishes") and spec.get("ttlSecondsAfterFinished", 0) > 0:
            errors.append("shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished")
        if spec.get("submissionMode") == "SidecarMode" and "submitterConfig" in spec:
            errors.append("SidecarMode doesn't support SubmitterConfig")
        if spec.get("backoffLimit", 0) < 0 or spec.get("submitterConfig", {}).get("backoffLimit", 0) < 0:
            errors.append("backoffLimit must be a positive integer")
        yaml.safe_load(spec.get("runtimeEnvYAML", ""))  # UnmarshalRuntimeEnvYAML: it must parse
        if spec.get("rayClusterSpec") is None:
            return errors
        spec = spec["rayClusterSpec"]
    for group in groups(spec):
        label = group.get("groupName", "Head")
        if not group["template"]["spec"].get("containers"):
            errors.append(f"{label}: should have at least one container")
        start = group.get("rayStartParams", {})
        if any(start.get(key) for key in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
            errors.append(f"{label}: resource fields should not be set in both rayStartParams and Resources")
        if "labels" in start:
            errors.append(f"{label}: rayStartParams['labels'] is not supported")
    autoscaling = spec.get("enableInTreeAutoscaling", False)
    for group in spec.get("workerGroupSpecs", []):
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (low is None or high is None):
            errors.append(f"worker group {group['groupName']} must set both minReplicas and maxReplicas")
        elif not 0 <= low <= group.get("replicas", low) <= high:
            errors.append(f"worker group {group['groupName']}: 0 <= minReplicas <= replicas <= maxReplicas")
    if spec.get("authOptions", {}).get("mode") == "token":
        version = tuple(int(part) for part in spec.get("rayVersion", "0").split("."))
        if version < (2, 52, 0):
            errors.append("authOptions.mode is 'token' but minimum Ray version is 2.52.0")
    return errors


def secret_refs(container: dict[str, Any]) -> dict[str, tuple[str, str, bool]]:
    """Environment name -> (Secret, key, optional) for the variables a container takes from a Secret."""
    refs = {}
    for variable in container.get("env", []):
        ref = variable.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            refs[variable["name"]] = (ref["name"], ref["key"], bool(ref.get("optional", False)))
    return refs


def kuberay_block() -> str:
    """The bash block of docs/cluster.md that applies the manifests."""
    blocks = re.findall(r"^```bash\n(.*?)^```$", (ROOT / "docs" / "cluster.md").read_text(), re.M | re.S)
    (block,) = [block for block in blocks if "kubectl apply" in block]
    return block


def docs_commands() -> list[list[str]]:
    """The block's commands, one a line, as words without their comments (`$(...)` and `&` stay as written)."""
    commands = [shlex.split(line, comments=True) for line in kuberay_block().splitlines()]
    return [words for words in commands if words]


# The manifests against KubeRay's CRDs


def test_every_manifest_is_a_known_kind_with_a_valid_name():
    found = manifests()
    assert {(document["apiVersion"], document["kind"]) for document in found} == KNOWN_KINDS
    for document in found:
        assert DNS1035.match(document["metadata"]["name"]), document["metadata"]


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_the_manifest_fits_kuberays_crd(kind):
    schema = load_subset()["kinds"][kind]
    jsonschema.Draft202012Validator.check_schema(schema)
    (document,) = [document for document in manifests() if document["kind"] == kind]
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft202012Validator(schema).iter_errors(document)
    ]
    assert not errors, errors
    stale = unchecked(document, schema)
    assert not stale, f"the CRD subset has these only by name; regenerate it (python -m tests.support.kuberay): {stale}"


def test_the_subset_says_where_it_came_from():
    source = load_subset()["source"]
    assert "KubeRay v1.7.0" in source and "ray.io_rayclusters.yaml" in source and "ray.io_rayjobs.yaml" in source


DELETE = object()
HEAD_CONTAINER = "spec/headGroupSpec/template/spec/containers/0"


def _set(document: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `document` with the value at `a/b/0/c` replaced (DELETE: removed)."""
    changed = copy.deepcopy(document)
    *parents, last = [int(part) if part.isdigit() else part for part in path.split("/")]
    node = changed
    for part in parents:
        node = node[part]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return changed


@pytest.mark.parametrize(
    ("document", "path", "value"),
    [
        (CLUSTER, "spec/headGroupSpec", DELETE),  # required
        (CLUSTER, "spec/workerGroupSpecs/0/groupName", DELETE),  # required
        (CLUSTER, "spec/workerGroupSpecs/0/minReplicas", DELETE),  # required by the CRD
        (CLUSTER, "spec/workerGroupSpecs/0/replicas", "2"),  # an integer
        (CLUSTER, "spec/headGroupSpec/rayStartParam", {}),  # a misspelt field: unknown
        (CLUSTER, "spec/headGroupSpec/rayStartParams/num-cpus", 1),  # a map of strings
        (CLUSTER, "spec/authOptions/mode", "tokens"),  # enum: disabled, token
        (CLUSTER, f"{HEAD_CONTAINER}/resources/limits/cpu", "two"),  # a quantity
        (CLUSTER, f"{HEAD_CONTAINER}/name", DELETE),  # a container needs a name
        (CLUSTER, f"{HEAD_CONTAINER}/ports/0/containerPort", "6379"),  # an integer
        (CLUSTER, f"{HEAD_CONTAINER}/env/0/valueFrom/secretKeyRef/key", DELETE),  # required
        (CLUSTER, f"{HEAD_CONTAINER}/env/0/valueFrom/secretKeyRef/optional", "no"),  # a boolean
        (JOB, "spec/shutdownAfterJobFinishes", "yes"),  # a boolean
        (JOB, "spec/shutdownAfterJobFinished", True),  # misspelt
        (JOB, "spec/submitterConfig/backoffLimit", "2"),  # an integer
        (JOB, "spec/entrypoint", ["raysim", "run"]),  # a string
        (JOB, "spec/rayClusterSpec/workerGroupSpecs/0/template", DELETE),  # the cluster spec is checked too
    ],
)
def test_the_subset_refuses_what_the_api_server_refuses(document, path, value):
    schema = load_subset()["kinds"][document["kind"]]
    assert jsonschema.Draft202012Validator(schema).is_valid(document)
    assert not jsonschema.Draft202012Validator(schema).is_valid(_set(document, path, value))


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_the_operator_accepts_the_manifest(kind):
    (document,) = [document for document in manifests() if document["kind"] == kind]
    assert operator_errors(kind, document) == []


@pytest.mark.parametrize(
    ("document", "path", "value", "error"),
    [
        (CLUSTER, "metadata/name", "raysim_cluster", "DNS-1035"),
        (CLUSTER, "metadata/name", "r" * 54, "DNS-1035"),
        (JOB, "metadata/name", "r" * 48, "DNS-1035"),
        (CLUSTER, "spec/workerGroupSpecs/0/replicas", 5, "minReplicas <= replicas <= maxReplicas"),
        (CLUSTER, "spec/workerGroupSpecs/0/maxReplicas", DELETE, "must set both"),
        (CLUSTER, "spec/headGroupSpec/resources", {"coordinator": "1"}, "both rayStartParams and Resources"),
        (CLUSTER, "spec/rayVersion", "2.51.0", "minimum Ray version is 2.52.0"),
        (CLUSTER, "spec/headGroupSpec/template/spec/containers", [], "at least one container"),
        (JOB, "spec/shutdownAfterJobFinishes", False, "cannot have TTLSecondsAfterFinished"),
        (JOB, "spec/rayClusterSpec", DELETE, "one of RayClusterSpec or ClusterSelector"),
        (JOB, "spec/submissionMode", "SidecarMode", "doesn't support SubmitterConfig"),
        (JOB, "spec/submitterConfig/backoffLimit", -1, "backoffLimit"),
    ],
)
def test_the_operator_checks_catch_what_kuberay_refuses(document, path, value, error):
    errors = operator_errors(document["kind"], _set(document, path, value))
    assert any(error in line for line in errors), errors


def test_the_rayjob_runs_on_a_cluster_of_the_rayclusters_spec():
    assert JOB["spec"]["rayClusterSpec"] == CLUSTER["spec"]


def test_the_rayjob_shuts_its_cluster_down_and_retries_its_submitter():
    spec = JOB["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] >= 0
    assert spec["submissionMode"] == "K8sJobMode" and spec["submitterConfig"]["backoffLimit"] >= 1


# The manifests against docker/


def test_same_image_and_ray_as_docker():
    node = COMPOSE["x-raysim-node"]
    ray = re.search(r"^ARG BASE_IMAGE=rayproject/ray:([\d.]+)-", DOCKERFILE, re.M).group(1)
    for where, spec in cluster_specs():
        assert spec["rayVersion"] == ray, where
        for container in ray_containers(spec):
            assert container["image"] == node["image"], (where, container["name"])
    (mlflow,) = MLFLOW["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert mlflow["image"] == COMPOSE["services"]["mlflow"]["image"]


def test_same_ports_as_compose():
    services = COMPOSE["services"]
    head = compose_flags(services["ray-head"]["command"])
    worker = compose_flags(services["ray-worker"]["command"])
    published = {int(port.rsplit(":", 1)[1]) for port in services["ray-head"]["ports"]}
    for where, spec in cluster_specs():
        (container, *_) = ray_containers(spec)
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert ports == RAY_PORTS, where
        start = spec["headGroupSpec"]["rayStartParams"]
        assert (
            int(start["port"]) == int(head["port"]) == int(worker["address"].rsplit(":", 1)[1]) == ports["gcs-server"]
        )
        assert int(start["dashboard-port"]) == int(head["dashboard-port"]) == ports["dashboard"]
        assert start["dashboard-host"] == head["dashboard-host"] == "0.0.0.0"
        assert published <= set(ports.values()), where
    mlflow = compose_flags(services["mlflow"]["command"])
    (container,) = MLFLOW["Deployment"]["spec"]["template"]["spec"]["containers"]
    (service_port,) = MLFLOW["Service"]["spec"]["ports"]
    (container_port,) = container["ports"]
    assert service_port["targetPort"] == container_port["name"]
    assert service_port["port"] == container_port["containerPort"] == int(mlflow["port"])
    assert {int(port.rsplit(":", 1)[1]) for port in services["mlflow"]["ports"]} == {service_port["port"]}


def test_the_mlflow_server_runs_with_composes_flags_but_its_stores():
    compose = compose_flags(COMPOSE["services"]["mlflow"]["command"])
    (container,) = MLFLOW["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["mlflow", "server"]
    ours = compose_flags(shlex.join(container["command"]))
    stores = {"backend-store-uri", "artifacts-destination"}
    assert {k: v for k, v in ours.items() if k not in stores} == {k: v for k, v in compose.items() if k not in stores}
    mount = container["volumeMounts"][0]["mountPath"]
    assert all(ours[key].removeprefix("sqlite:///").startswith(mount + "/") for key in stores)
    assert (
        MLFLOW["Deployment"]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
        == (MLFLOW["PersistentVolumeClaim"]["metadata"]["name"])
    )
    assert MLFLOW["Service"]["spec"]["type"] == "ClusterIP"  # no authentication: not exposed outside the cluster
    assert MLFLOW["Service"]["metadata"]["name"] in ours["allowed-hosts"].split(",")


def test_same_ray_start_resources_as_compose():
    head = compose_flags(COMPOSE["services"]["ray-head"]["command"])
    worker = compose_flags(COMPOSE["services"]["ray-worker"]["command"])
    workers = int(re.fullmatch(r"\$\{RAY_WORKERS:-(\d+)\}", COMPOSE["services"]["ray-worker"]["deploy"]["replicas"])[1])
    for where, spec in cluster_specs():
        start = spec["headGroupSpec"]["rayStartParams"]
        assert start_param(start["num-cpus"]) == head["num-cpus"], where
        assert json.loads(start_param(start["resources"])) == json.loads(head["resources"]), where
        for group in spec["workerGroupSpecs"]:
            assert json.loads(start_param(group["rayStartParams"]["resources"])) == json.loads(worker["resources"])
        assert sum(group["replicas"] for group in spec["workerGroupSpecs"]) == workers, where  # compose's default


def test_same_shared_memory_as_compose():
    size = quantity_bytes(COMPOSE["x-raysim-node"]["shm_size"])
    for where, spec in cluster_specs():
        for group in groups(spec):
            pod = group["template"]["spec"]
            (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert volume["emptyDir"]["medium"] == "Memory", where
            assert quantity_bytes(volume["emptyDir"]["sizeLimit"]) == size, where


def test_same_environment_names_as_compose():
    compose = COMPOSE["x-raysim-node"]["environment"]
    for where, spec in cluster_specs():
        assert spec["authOptions"] == {"mode": compose["RAY_AUTH_MODE"], "secretName": "raysim-ray-token"}, where
        for container in ray_containers(spec):
            names = {variable["name"] for variable in container["env"]}
            assert names.isdisjoint(TOKEN_ENV), "authOptions sets the token's variables; a container's own would win"
            assert set(compose) <= names | TOKEN_ENV, (where, container["name"], set(compose) - names - TOKEN_ENV)
            plain = {v["name"]: v["value"] for v in container["env"] if "value" in v}
            assert plain == {k: v for k, v in compose.items() if k in plain}, container["name"]
            refs = secret_refs(container)
            assert refs["MLFLOW_TRACKING_URI"] == ("raysim-mlflow", "MLFLOW_TRACKING_URI", False)
            assert {name for name in refs if name != "MLFLOW_TRACKING_URI"} == set(VARIABLES)
            for name in VARIABLES:  # credentials.py's names, each optional: a server may have none
                assert refs[name] == ("raysim-mlflow", name, True), (container["name"], name)
        assert len({json.dumps(container["env"]) for container in ray_containers(spec)}) == 1, "same env everywhere"


def test_the_rayjob_entrypoint_is_a_raysim_run_of_a_config_the_image_ships():
    entrypoint = JOB["spec"]["entrypoint"]
    # KubeRay's submitter expands variables in its own pod; `ray job submit` quotes what reaches the driver
    assert "$" not in entrypoint
    words = shlex.split(entrypoint)
    assert words[:2] == ["raysim", "run"]
    arguments = parser().parse_args(words[1:])
    workdir = re.search(r"^WORKDIR (\S+)$", DOCKERFILE, re.M).group(1)
    relative = arguments.config.removeprefix(workdir + "/")
    assert relative != arguments.config, f"{arguments.config} is not under the image's WORKDIR {workdir}"
    copied = re.findall(r"^COPY --chown=\S+ (\S+) \./(\S*)$", DOCKERFILE, re.M)
    assert (relative.split("/")[0], relative.split("/")[0]) in copied, f"docker/Dockerfile does not copy {relative}"
    config = load_config(ROOT / relative, arguments.set)
    assert arguments.tracking_uri is None and config.tracking.uri is None  # the head's $MLFLOW_TRACKING_URI decides
    assert config.dataset.name == "fashion_mnist" and "python -m raysim.data.fetch" in DOCKERFILE  # baked in


# docs/cluster.md's commands against the manifests


def test_the_docs_apply_the_manifests_and_create_the_secrets_they_read():
    commands = docs_commands()
    applied = {words[3] for words in commands if words[:3] == ["kubectl", "apply", "-f"]}
    assert applied == {f"deploy/kuberay/{path.name}" for path in DEPLOY.glob("*.yaml")}
    created: dict[str, dict[str, str]] = {}
    for words in commands:
        if words[:4] == ["kubectl", "create", "secret", "generic"]:
            literals = [word.split("=", 1)[1] for word in words[5:] if word.startswith("--from-literal=")]
            created[words[4]] = dict(literal.split("=", 1) for literal in literals)
    for _, spec in cluster_specs():
        assert TOKEN_KEY in created[spec["authOptions"]["secretName"]]
        for container in ray_containers(spec):
            for secret, key, optional in secret_refs(container).values():
                assert optional or key in created.get(secret, {}), f"the docs create no {secret} with key {key}"
    uri = created["raysim-mlflow"]["MLFLOW_TRACKING_URI"]
    assert uri == f"http://{MLFLOW['Service']['metadata']['name']}:{MLFLOW['Service']['spec']['ports'][0]['port']}"


def test_the_docs_submit_through_the_head_service_with_the_clusters_token():
    commands = docs_commands()
    (forward,) = [
        words
        for words in commands
        if words[:3] == ["kubectl", "port-forward", f"svc/{CLUSTER['metadata']['name']}-head-svc"]
    ]
    local, remote = map(int, forward[3].split(":"))
    assert remote == RAY_PORTS["dashboard"]
    (submit,) = [words for words in commands if words[:2] == ["raysim", "submit"]]
    arguments = parser().parse_args(submit[1:])
    assert arguments.address == f"http://127.0.0.1:{local}"
    secrets = {words[4]: words for words in commands if words[:4] == ["kubectl", "create", "secret", "generic"]}
    assert f"--from-literal=MLFLOW_TRACKING_URI={arguments.tracking_uri}" in secrets["raysim-mlflow"]
    load_config(ROOT / arguments.config, arguments.set)
    token = CLUSTER["spec"]["authOptions"]["secretName"]
    assert (
        f"RAY_AUTH_TOKEN=$(kubectl get secret {token} -o jsonpath='{{.data.{TOKEN_KEY}}}' | base64 -d)"
        in kuberay_block()
    )
    (wait,) = [words for words in commands if words[:2] == ["kubectl", "wait"]]
    assert wait[2] == f"raycluster/{CLUSTER['metadata']['name']}"
    (logs,) = [words for words in commands if words[:2] == ["kubectl", "logs"]]
    assert f"job-name={JOB['metadata']['name']}" in logs  # the submitter's Kubernetes Job is named after the RayJob
