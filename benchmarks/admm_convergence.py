"""Plot the ADMM convergence diagnostics of one run from its MLflow store (docs/algorithms.md, ADMM convergence).

    raysim run configs/quickstart.yaml --set algorithm.diagnostics=true --tracking-uri sqlite:////tmp/adm/mlflow.db
    python benchmarks/admm_convergence.py sqlite:////tmp/adm/mlflow.db docs/img/flame_admm_convergence.png

The newest run of the store is plotted (or `--run RUN_ID`): the Lagrangian, the primal residual, the dual norms and
||sum_i pi_i||, the stationarity residual and Delta Gamma (Lemma 1's successive change) against the round, the
residuals on a log scale.
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

PANELS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("augmented Lagrangian L(P^t)", ("server/lagrangian",), False),
    ("primal residual ||w_i - w||", ("update/primal_residual", "update/primal_residual_max"), True),
    ("duals", ("update/dual_norm", "update/dual_norm_max", "server/dual_sum_norm"), True),
    ("stationarity residual (17)", ("update/stationarity", "update/stationarity_max"), True),
    ("successive change Delta Gamma", ("server/successive_change",), True),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tracking_uri")
    parser.add_argument("output", help="PNG path")
    parser.add_argument("--run", help="run id (default: the newest run of the store)")
    args = parser.parse_args()
    client = MlflowClient(args.tracking_uri)
    run_id = args.run
    if run_id is None:
        experiments = [e.experiment_id for e in client.search_experiments()]
        run_id = client.search_runs(experiments, order_by=["attributes.start_time DESC"], max_results=1)[0].info.run_id
    figure, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for axis, (title, keys, log) in zip(axes, PANELS, strict=True):
        for key in keys:
            history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
            axis.plot([m.step for m in history], [m.value for m in history], label=key)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("round")
        if log:
            axis.set_yscale("log")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
