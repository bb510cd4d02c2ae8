"""Run one FL-bench method on the reference setting and write its per-round, per-client test accuracies as JSON.

This runs in a separate venv holding FL-bench's dependencies (README.md), never raysim's: it imports FL-bench from
its checkout (`--flbench`), changes nothing in its methods, and only wraps four of its functions from outside to
record what it already computes:

- `FedAvgServer.init_model`: the initial global model (to check it equals raysim's `model.init: authors` draw);
- `FedAvgServer.run_experiment`: afterwards, every client's "before" and "after" local-training test accuracy and
  test-set size of every round (FL-bench's `client_metrics`, from which its own curve is the pooled accuracy), and
  FedFomo's affinity matrix `P`;
- `FedAvgServer.test_client_models` and `FedAvgClient.test`: each client's accuracy in FL-bench's periodic
  evaluation (`common.test.client.interval`), with and without its `finetune_epoch` epochs of fine-tuning (FedBABU's
  personalized model), tagged with the number of rounds done.

`--heavy-ball` (a diagnostic, FedAvgM only) also wraps `FedAvgMServer.__init__` to turn off the Nesterov flag of
the server optimizer it builds. One setting is changed from FL-bench's defaults on purpose: Fashion-MNIST is
normalized with raysim's constants (MNIST's mean 0.1307 and std 0.3081, raysim.data.idx) instead of FL-bench's
0.286 / 0.3205, so both sides train on the same input floats. Usage (from anywhere, with the reference venv's python):

    /tmp/refvenv/bin/python benchmarks/reference/flbench_run.py --flbench /tmp/flbench --method fedper \
        --out /tmp/ref/fedper.json [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import sys
from pathlib import Path

RAYSIM_MEAN, RAYSIM_STD = [0.1307], [0.3081]

COMMON = [
    "dataset.name=fmnist",
    "common.seed=42",
    "common.join_ratio=1.0",
    "common.global_epoch=20",
    "common.local_epoch=1",
    "common.batch_size=32",
    "optimizer.name=sgd",
    "optimizer.lr=0.01",
    "optimizer.momentum=0",
    "optimizer.weight_decay=0",
    "common.use_cuda=false",
    "mode=serial",
    "common.verbose_gap=1000",
    "common.save_learning_curve_plot=false",
    "common.buffers=global",
]
"""The recorded setting (curves.json): full participation, 1 local epoch of SGD at lr 0.01, batch 32, seed 42."""

PER_METHOD = {
    "fedavgm": ["model.name=2nn"],
    "moon": ["model.name=2nn"],
    "fedper": ["model.name=2nn"],
    "fedbabu": ["model.name=2nn", "common.test.client.interval=1", "common.test.client.finetune_epoch=1"],
    "fedfomo": ["model.name=2nn"],
    "fedbn": ["model.name=lenet5"],
}


def torchvision_on_cpu_torch() -> None:
    """torchvision 0.28.0 from PyPI is a CUDA build: with the CPU torch its import fails on the missing `nms`/`qnms`
    schemas (pytorch/vision#9085). Define them when its native library does not load (raysim.torchvision_compat
    does the same in raysim's venv; FL-bench uses only datasets, transforms and models)."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    native = next(Path(spec.origin).parent.glob("_C*.so"), None)
    if native is not None:
        try:
            torch.ops.load_library(str(native))
            return
        except OSError:
            pass
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    torchvision_on_cpu_torch.library = library  # keep it alive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flbench", type=Path, required=True, help="FL-bench checkout (its data/fmnist/ written)")
    parser.add_argument("--method", required=True, choices=sorted(PER_METHOD))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--heavy-ball",
        action="store_true",
        help="diagnostic, FedAvgM only: turn off the Nesterov flag of FL-bench's server optimizer after it is built "
        "(torch SGD with momentum 0.9, lr 1), i.e. the heavy-ball momentum raysim's fedavgm implements",
    )
    args, extra = parser.parse_known_args()
    root = args.flbench.resolve()
    torchvision_on_cpu_torch()
    import torch

    torch.set_num_threads(1)
    os.chdir(root)
    sys.path.insert(0, str(root))
    from src.client.fedavg import FedAvgClient
    from src.server.fedavg import FedAvgServer
    from src.utils import constants

    constants.DATA_MEAN["fmnist"], constants.DATA_STD["fmnist"] = RAYSIM_MEAN, RAYSIM_STD
    periodic: list[dict] = []
    state = {"rounds_done": None}

    original_run = FedAvgServer.run_experiment
    original_init_model = FedAvgServer.init_model
    original_test_clients = FedAvgServer.test_client_models
    original_client_test = FedAvgClient.test

    def init_model(self, *a, **k):
        original_init_model(self, *a, **k)
        self._reference_initial = {name: p.detach().clone() for name, p in self.model.state_dict().items()}

    def test_client_models(self):
        state["rounds_done"] = self.current_epoch + 1
        return original_test_clients(self)

    def client_test(self, server_package):
        results = original_client_test(self, server_package)
        periodic.append(
            {
                "round": state["rounds_done"],
                "client": int(self.client_id),
                "before": results["before"]["test"].accuracy,
                "after": results["after"]["test"].accuracy,
                "size": results["before"]["test"].size,
            }
        )
        return results

    def run_experiment(self):
        original_run(self)
        rounds = self.args.common.global_epoch
        clients = sorted(self.client_metrics)
        record = {
            "method": args.method,
            "heavy_ball": args.heavy_ball,
            "algorithm_name": self.algorithm_name,
            "args": json.loads(json.dumps(__import__("omegaconf").OmegaConf.to_object(self.args), default=str)),
            "clients": clients,
            "test_size": [self.client_metrics[c][0]["before"]["test"].size for c in clients],
            "before": [[self.client_metrics[c][r]["before"]["test"].accuracy for c in clients] for r in range(rounds)],
            "after": [[self.client_metrics[c][r]["after"]["test"].accuracy for c in clients] for r in range(rounds)],
            "periodic": periodic,
            "initial_model": {k: v.flatten().tolist() for k, v in self._reference_initial.items()},
        }
        if hasattr(self, "P"):  # FedFomo's affinity matrix (identity at the start, raw weights added)
            record["affinity"] = self.P.tolist()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record))

    if args.heavy_ball:
        from src.server.fedavgm import FedAvgMServer

        original_fedavgm_init = FedAvgMServer.__init__

        def fedavgm_init(self, *a, **k):
            original_fedavgm_init(self, *a, **k)
            for group in self.global_optmizer.param_groups:
                group["nesterov"] = False

        FedAvgMServer.__init__ = fedavgm_init
    FedAvgServer.init_model = init_model
    FedAvgServer.test_client_models = test_client_models
    FedAvgClient.test = client_test
    FedAvgServer.run_experiment = run_experiment
    sys.argv = ["main.py", f"method={args.method}", *COMMON, *PER_METHOD[args.method], *extra]
    runpy.run_path(str(root / "main.py"), run_name="__main__")


if __name__ == "__main__":
    main()
