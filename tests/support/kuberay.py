"""KubeRay's CRD schemas, cut down to what deploy/kuberay/ uses, for tests/unit/test_kuberay.py.

The CRDs (ray-operator/config/crd/bases/ray.io_rayclusters.yaml and ray.io_rayjobs.yaml of KubeRay, 0.9 MB and
1.4 MB, mostly Kubernetes' own PodSpec) are not vendored. `python -m tests.support.kuberay CRD_FOLDER` writes
SUBSET from them: for each kind, the `ray.io/v1` openAPIV3Schema with every node the manifests reach kept whole
(type, required, enum, pattern, format, minimum, items, maps) and every property they do not use kept by name only
(UNUSED), descriptions dropped; an object with properties gets
`additionalProperties: false`, since the API server refuses an unknown field (kubectl's strict field validation).
Kubernetes' `x-kubernetes-int-or-string` becomes an integer-or-string `anyOf`. A node the manifests use that
carries CEL rules (`x-kubernetes-validations`) stops the cut: jsonschema cannot check them, so they would need
checking by hand. Rerun it when a manifest uses a field the subset has only by name (the test says which).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy" / "kuberay"
SUBSET = Path(__file__).with_name("kuberay_crd_subset.json")
KINDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
UNUSED = True
"""The schema of a property the manifests do not use: JSON Schema's `true`, which accepts anything."""
KEPT = ("type", "required", "enum", "pattern", "format", "minimum", "maximum", "minLength", "maxLength", "minItems")


def documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of a manifest file (a `---`-separated stream), empty ones left out."""
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def manifests() -> list[dict[str, Any]]:
    """Every document of deploy/kuberay/*.yaml."""
    return [document for path in sorted(DEPLOY.glob("*.yaml")) for document in documents(path)]


def cut(schema: dict[str, Any], instances: list[Any], where: str = "") -> dict[str, Any]:
    """`schema` reduced to what `instances` (the values found at this node in the manifests) reach."""
    if "x-kubernetes-validations" in schema:
        raise ValueError(
            f"{where or '/'}: CEL rules, which jsonschema cannot check: {schema['x-kubernetes-validations']}"
        )
    out: dict[str, Any] = {key: schema[key] for key in KEPT if key in schema}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    elif "anyOf" in schema:
        out["anyOf"] = [{key: value for key, value in branch.items() if key in KEPT} for branch in schema["anyOf"]]
    if "properties" in schema:
        objects = [instance for instance in instances if isinstance(instance, dict)]
        out["properties"] = {
            name: cut(child, [o[name] for o in objects if name in o], f"{where}/{name}")
            if any(name in o for o in objects)
            else UNUSED
            for name, child in sorted(schema["properties"].items())
        }
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    elif isinstance(schema.get("additionalProperties"), dict):
        values = [value for instance in instances if isinstance(instance, dict) for value in instance.values()]
        out["additionalProperties"] = cut(schema["additionalProperties"], values, f"{where}/*")
    if "items" in schema:
        elements = [element for instance in instances if isinstance(instance, list) for element in instance]
        out["items"] = cut(schema["items"], elements, f"{where}[]")
    return out


def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    """The `v1` version's openAPIV3Schema of a CustomResourceDefinition."""
    (version,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def write_subset(crd_folder: Path, source: str) -> dict[str, Any]:
    """SUBSET from the CRDs in `crd_folder` and the manifests as they are; `source`: where the CRDs came from."""
    subset: dict[str, Any] = {
        "source": source,
        "made_by": "python -m tests.support.kuberay CRD_FOLDER SOURCE (tests/support/kuberay.py says how it is cut)",
        "kinds": {},
    }
    found = manifests()
    for kind, name in KINDS.items():
        crd = yaml.safe_load((crd_folder / name).read_text())
        instances = [document for document in found if document.get("kind") == kind]
        subset["kinds"][kind] = cut(crd_schema(crd), instances)
    SUBSET.write_text(json.dumps(subset, indent=1, sort_keys=True) + "\n")
    return subset


def load_subset() -> dict[str, Any]:
    """The checked-in subset: {"source": ..., "kinds": {kind: JSON schema}}."""
    return json.loads(SUBSET.read_text())


def unchecked(instance: Any, schema: dict[str, Any] | bool, where: str = "") -> list[str]:
    """The paths of `instance` that the subset has by name only (UNUSED): the subset is older than the manifest."""
    if schema is UNUSED:
        return [where or "/"]
    found: list[str] = []
    if isinstance(instance, dict):
        properties = schema.get("properties")
        values = schema.get("additionalProperties")
        for key, value in instance.items():
            child = properties.get(key) if properties is not None else values if isinstance(values, dict) else None
            if child is not None:
                found += unchecked(value, child, f"{where}/{key}")
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for index, element in enumerate(instance):
            found += unchecked(element, schema["items"], f"{where}[{index}]")
    return found


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.support.kuberay CRD_FOLDER SOURCE  (SOURCE: e.g. 'KubeRay v1.7.0, ...')")
    written = write_subset(Path(sys.argv[1]), sys.argv[2])
    print(f"{SUBSET}: {', '.join(written['kinds'])} ({SUBSET.stat().st_size} bytes)")
