"""Writes the field benchmark suites (configs/paper/suites/field_benchmark_{fmnist,cifar10}.yaml) from the baselines
suite's methods (configs/compare.yaml): every method of raysim on Dir(0.1) and on 2 label shards, 100 clients at
10 % participation, 3 seeds, each method at the local work compare.yaml gives it. A method added to compare.yaml
is in both suites once this runs again (`python benchmarks/field_benchmark.py`); tests/unit/test_field_benchmark.py
fails while the shipped files differ from what it writes.

    raysim run configs/paper/suites/field_benchmark_fmnist.yaml
    raysim table PARENT_RUN --metrics pm/acc pm/acc_p10 pm/loss_var gm/acc --std
    raysim figure PARENT_RUN
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPARE = ROOT / "configs" / "compare.yaml"
SUITES = ROOT / "configs" / "paper" / "suites"

SPLITS = {"dir0.1": {"scheme": "dirichlet", "beta": 0.1}, "shards2": {"scheme": "q_label", "q": 2}}
"""The two splits: Dirichlet(0.1) over labels and the pathological 2 label shards per client."""

DATASETS: dict[str, dict[str, Any]] = {
    "fmnist": {"dataset": {"name": "fashion_mnist"}, "models": {"mlp": "mlp", "mlp_bn": "mlp_bn"}, "rounds": 50},
    "cifar10": {
        "dataset": {"name": "cifar10"},
        "models": {"mlp": "cnn", "mlp_bn": "cnn_bn"},
        "rounds": 200,
    },
}
"""Per dataset: its section, the model each of compare.yaml's models becomes (the MLP and its BatchNorm variant on
Fashion-MNIST, the CIFAR CNN and its BatchNorm variant on CIFAR-10) and the rounds."""

HEADER = """# The field benchmark on {title} (issue 47): every method of raysim but those that need a pretrained model
# on held-back samples (AugFL, KD only, FedLP, FedPCL: configs/paper/suites/augfl_*_table2.yaml), on Dir(0.1) and on
# 2 label shards per client, 100 clients, 10 sampled a round, {rounds} rounds, seeds 1-3; each method at the local
# work configs/compare.yaml gives it (one epoch of SGD at eta 0.05, batch 100, per phase). Written by
# benchmarks/field_benchmark.py from configs/compare.yaml: edit that and run it again, not this file.{data}
#   raysim run configs/paper/suites/field_benchmark_{key}.yaml
#   raysim table PARENT_RUN --metrics pm/acc pm/acc_p10 pm/loss_var gm/acc --std
#   raysim figure PARENT_RUN
"""

TITLES = {"fmnist": "Fashion-MNIST", "cifar10": "CIFAR-10"}
DATA_NOTES = {
    "fmnist": "",
    "cifar10": "\n# Data: torchvision's cifar-10-batches-py/ under dataset.root (--set dataset.root=DATA).",
}


def _merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` applied section by section (a dotted key sets one value)."""
    merged = copy.deepcopy(base)
    for key, value in changes.items():
        section, _, field = key.partition(".")
        if field:
            merged.setdefault(section, {})[field] = value
        else:
            merged[section] = copy.deepcopy(value)
    return merged


def suite(key: str) -> dict[str, Any]:
    """The field benchmark suite of one dataset, as a mapping."""
    compare = yaml.safe_load(COMPARE.read_text())
    spec = DATASETS[key]
    base = {
        **copy.deepcopy(compare["base"]),
        "dataset": spec["dataset"],
        "model": {"name": spec["models"][compare["base"]["model"]["name"]]},
        "clients": {"count": 100, "per_round": 10},
        "rounds": spec["rounds"],
        "tracking": {"experiment": f"field_benchmark_{key}"},
    }
    base.pop("partition", None)
    runs = []
    for run in compare["runs"]:
        for split, partition in SPLITS.items():
            changes = _merged({"partition": partition}, run["set"])
            if "model" in changes:
                changes["model"] = {**changes["model"], "name": spec["models"][changes["model"]["name"]]}
            runs.append({"name": f"{run['name']}-{split}", "set": changes})
    return {"name": f"field_benchmark_{key}", "base": base, "seeds": [1, 2, 3], "runs": runs}


def text(key: str) -> str:
    """The suite file's text: its header and the suite in YAML (one line per run)."""
    data = suite(key)
    header = HEADER.format(title=TITLES[key], rounds=data["base"]["rounds"], key=key, data=DATA_NOTES[key])
    body = yaml.safe_dump({k: v for k, v in data.items() if k != "runs"}, sort_keys=False, width=120)
    lines = [f"  - name: {run['name']}\n    set: {_flow(run['set'])}" for run in data["runs"]]
    return header + body + "runs:\n" + "\n".join(lines) + "\n"


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()


def main() -> int:
    for key in DATASETS:
        path = SUITES / f"field_benchmark_{key}.yaml"
        path.write_text(text(key))
        print(f"written {path.relative_to(ROOT)} ({len(suite(key)['runs'])} runs x 3 seeds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
