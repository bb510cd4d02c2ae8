"""Run raysim's side of the reference check and print its curves beside FL-bench's recorded ones (README.md).

    .venv/bin/python benchmarks/reference/run.py                      # all six methods, 20 rounds each
    .venv/bin/python benchmarks/reference/run.py fedper moon --plot benchmarks/reference/curves.png
    .venv/bin/python benchmarks/reference/run.py --record /tmp/ref    # rewrite curves.json from flbench_run.py's JSON

Every curve is the mean over the 20 clients of each client's test accuracy, in percent (raysim's `pm/acc`, `gm/acc`;
FL-bench's own log pools the clients' test samples instead: curves.json keeps that curve too, as `pooled`). Each
method's entry in curves.json says which raysim metric at which round each recorded point is compared with (`pairs`):
FL-bench scores a client's model at the start of round r (before its local training), which is raysim's score after
r rounds; FedFomo's personalized model is the one after local training; FedBABU's fine-tuned model is raysim's PM one
round later (raysim fine-tunes the model a client receives, at the start of its next step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CURVES = HERE / "curves.json"
METHODS = ("fedavgm", "moon", "fedper", "fedbabu", "fedbn", "fedfomo")

FLBENCH = {
    "library": "FL-bench",
    "repository": "https://github.com/KarhouTam/FL-bench",
    "commit": "06e658bca5af6ce732e25bb7c0f8be321e14a85e",
    "commit_date": "2025-10-09",
}


def load_reference(path: Path = CURVES) -> dict:
    return json.loads(path.read_text())


def config_path(method: str) -> Path:
    return HERE / f"{method}.yaml"


def raysim_history(method: str, rounds: int, tracking_uri: str, partition_dir: Path | None = None, progress=False):
    """raysim's round history (a DataFrame) of `method` on the recorded setting, in process, for `rounds` rounds;
    the partition files from `partition_dir` (default: the committed ones here, by absolute path, so that it runs
    from any folder)."""
    import raysim

    name = "partition_val.parquet" if method == "fedfomo" else "partition.parquet"
    folder = HERE if partition_dir is None else Path(partition_dir)
    overrides = [f"rounds={rounds}", "runtime.actors=in_process", f"partition.path={folder / name}"]
    result = raysim.run(
        config_path(method), *overrides, progress=progress, tracking_uri=tracking_uri, personalized=False
    )
    return result.history


def raysim_points(history, pairs: list[dict]) -> list[float]:
    """raysim's value (percent) for each recorded point: `metric` after `step` rounds."""
    return [100.0 * float(history.loc[p["step"], p["metric"]]) for p in pairs]


def pairs_upto(entry: dict, rounds: int) -> list[dict]:
    """The recorded points whose raysim counterpart needs at most `rounds` rounds."""
    return [p for p in entry["pairs"] if p["step"] <= rounds]


def gaps(library: list[float], ours: list[float]) -> tuple[float, float]:
    diff = np.abs(np.asarray(library) - np.asarray(ours))
    return float(diff.mean()), float(diff.max())


# ---------------------------------------------------------------------------------------------------------------
# Recording FL-bench's curves (flbench_run.py's JSON -> curves.json)


def client_mean(rows: list[list[float]]) -> list[float]:
    return [float(np.mean(r)) for r in rows]


def pooled(rows: list[list[float]], sizes: list[int]) -> list[float]:
    w = np.asarray(sizes, float)
    return [float(np.asarray(r) @ w / w.sum()) for r in rows]


STATISTICS = ("running_mean", "running_var")


def initial_digest(initial: dict[str, list[float]]) -> str:
    """sha256 of FL-bench's initial model as raysim lays a model out: the parameters in module order, then the
    BatchNorm running statistics (raysim.models.zoo.carried_buffers; the batch counter is not carried)."""
    import hashlib

    params = [k for k in initial if not any(s in k for s in (*STATISTICS, "num_batches_tracked"))]
    stats = [k for k in initial if any(s in k for s in STATISTICS)]
    vector = np.concatenate([np.asarray(initial[k], np.float32) for k in params + stats])
    return hashlib.sha256(vector.tobytes()).hexdigest()


def record(folder: Path) -> dict:
    """curves.json's content from flbench_run.py's outputs `folder/<method>.json`."""
    from partition import SETTING  # benchmarks/reference/partition.py

    out = {
        **FLBENCH,
        "runner": "benchmarks/reference/flbench_run.py (FL-bench's main.py, serial mode, CPU)",
        "dataset": "Fashion-MNIST (70,000 pooled: train then test), normalized with mean 0.1307, std 0.3081",
        "partition": {**SETTING, "scheme": "FL-bench's Dirichlet, benchmarks/reference/partition.py"},
        "training": {
            "rounds": 20,
            "join_ratio": 1.0,
            "local_epoch": 1,
            "batch_size": 32,
            "optimizer": "sgd",
            "lr": 0.01,
            "momentum": 0.0,
            "weight_decay": 0.0,
            "seed": 42,
        },
        "metric": "mean over clients of the client's test accuracy, percent",
        "methods": {},
    }
    for method in METHODS:
        path = folder / f"{method}.json"
        if not path.exists():
            continue
        run = json.loads(path.read_text())
        sizes, before, after = run["test_size"], run["before"], run["after"]
        entry = {
            "flbench_method": method,
            "model": run["args"]["model"]["name"],
            "raysim_config": f"benchmarks/reference/{method}.yaml",
            "hyperparameters": run["args"].get(method, {}),
            "initial_model_sha256": initial_digest(run["initial_model"]),
        }
        if method == "fedfomo":
            entry["what"] = (
                "each client's personalized model after its local training in round r+1 (FL-bench's "
                "'after' of round r+1; raysim pm/acc after r+1 rounds)"
            )
            entry["curve"] = client_mean(after)
            entry["pooled"] = pooled(after, sizes)
            entry["pairs"] = [{"metric": "pm/acc", "step": r + 1} for r in range(len(after))]
            entry["before_local_training"] = client_mean(before)
            if "affinity" in run:
                a = np.asarray(run["affinity"])
                entry["affinity_offdiag_max"] = float((a - np.diag(np.diag(a))).max())
                entry["affinity_diag_min"] = float(np.diag(a).min())
        elif method == "fedbabu":
            rounds = sorted({p["round"] for p in run["periodic"]})
            tuned = [[p["after"] for p in run["periodic"] if p["round"] == r] for r in rounds]
            tsizes = [[p["size"] for p in run["periodic"] if p["round"] == r] for r in rounds]
            entry["what"] = (
                "PM: the global model after r rounds fine-tuned 1 epoch on each client's training set "
                "(FL-bench's test with finetune_epoch 1; raysim pm/acc after r+1 rounds); GM: the "
                "global model after r rounds (FL-bench's 'before' of round r+1; raysim gm/acc)"
            )
            entry["curve"] = [float(np.mean(t)) for t in tuned]
            entry["pooled"] = [
                float(np.asarray(t) @ np.asarray(s) / np.sum(s)) for t, s in zip(tuned, tsizes, strict=True)
            ]
            entry["pairs"] = [{"metric": "pm/acc", "step": r + 1} for r in rounds]
            entry["rounds"] = rounds
            entry["gm_curve"] = client_mean(before)
            entry["gm_pooled"] = pooled(before, sizes)
            entry["gm_pairs"] = [{"metric": "gm/acc", "step": r} for r in range(len(before))]
        else:
            entry["what"] = (
                "each client's model at the start of round r+1, before local training (FL-bench's "
                "'before'; raysim pm/acc after r rounds)"
            )
            entry["curve"] = client_mean(before)
            entry["pooled"] = pooled(before, sizes)
            entry["pairs"] = [{"metric": "pm/acc", "step": r} for r in range(len(before))]
        heavy = folder / f"{method}_heavyball.json"
        if method == "fedavgm" and heavy.exists():
            # FL-bench's FedAvgM steps with torch's SGD(momentum 0.9, nesterov=True); raysim's (and Hsu et al.'s)
            # is heavy-ball momentum. flbench_run.py --heavy-ball turns the flag off: the same algorithm as raysim's.
            hb = json.loads(heavy.read_text())
            entry["heavy_ball_curve"] = client_mean(hb["before"])
            entry["heavy_ball_pooled"] = pooled(hb["before"], hb["test_size"])
            entry["test_against"] = "heavy_ball_curve"
        out["methods"][method] = entry
    return out


# ---------------------------------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    methods = list(results)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharey=False)
    for ax, method in zip(axes.flat, methods, strict=False):
        r = results[method]
        steps = [p["step"] for p in r["pairs"]]
        label = "FL-bench, heavy-ball momentum" if r["against"] == "heavy_ball_curve" else "FL-bench"
        ax.plot(steps, r["library"], "o-", ms=3, label=label)
        if "published" in r:
            ax.plot(steps, r["published"], "^:", ms=3, color="grey", label="FL-bench as published (Nesterov)")
        ax.plot(steps, r["raysim"], "s--", ms=3, label="raysim")
        if "gm_library" in r:
            gsteps = [p["step"] for p in r["gm_pairs"]]
            ax.plot(gsteps, r["gm_library"], "o-", ms=2, alpha=0.5, label="FL-bench GM")
            ax.plot(gsteps, r["gm_raysim"], "s--", ms=2, alpha=0.5, label="raysim GM")
        ax.set_title(f"{method}: mean |gap| {r['mean_gap']:.2f}, max {r['max_gap']:.2f} pts")
        ax.set_xlabel("rounds done (raysim step)")
        ax.set_ylabel("mean client test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(methods) :]:
        ax.axis("off")
    fig.suptitle("raysim vs FL-bench (commit 06e658b), Fashion-MNIST, 20 clients Dir(0.1), same partition, init, seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=list(METHODS))
    parser.add_argument("--rounds", type=int, default=None, help="compare only the points within this many rounds")
    parser.add_argument("--plot", type=Path, help="write the side-by-side curves as a PNG")
    parser.add_argument("--tracking-uri", default="sqlite:////tmp/raysim-reference-mlflow.db")
    parser.add_argument("--record", type=Path, help="write curves.json from flbench_run.py's JSON files here")
    parser.add_argument("--json", type=Path, help="also write raysim's curves and the gaps as JSON")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.record:
        CURVES.write_text(json.dumps(record(args.record), indent=1) + "\n")
        print(f"wrote {CURVES}")
        return
    reference = load_reference()
    results = {}
    for method in args.methods:
        entry = reference["methods"][method]
        pairs = entry["pairs"] if args.rounds is None else pairs_upto(entry, args.rounds)
        need = max(p["step"] for p in pairs)
        gm_pairs = [p for p in entry.get("gm_pairs", []) if p["step"] <= need]
        history = raysim_history(method, need, args.tracking_uri)
        against = entry.get("test_against", "curve")
        library = entry[against][: len(pairs)]
        ours = raysim_points(history, pairs)
        mean_gap, max_gap = gaps(library, ours)
        results[method] = {
            "pairs": pairs,
            "library": library,
            "raysim": ours,
            "mean_gap": mean_gap,
            "max_gap": max_gap,
            "against": against,
        }
        published = entry["curve"][: len(pairs)]
        print(f"\n{method} ({entry['what']})")
        extra = f" {'published':>9} {'diff':>7}" if against != "curve" else ""
        print(
            f"{'step':>5} {'FL-bench':>9} {'raysim':>8} {'diff':>7}{extra}"
            + (f"   (FL-bench: {against})" if extra else "")
        )
        for p, a, b, c in zip(pairs, library, ours, published, strict=True):
            more = f" {c:9.2f} {b - c:7.2f}" if extra else ""
            print(f"{p['step']:>5} {a:9.2f} {b:8.2f} {b - a:7.2f}{more}")
        print(f"mean |diff| {mean_gap:.2f}, max |diff| {max_gap:.2f} points")
        if extra:
            p_mean, p_max = gaps(published, ours)
            results[method] |= {"published": published, "published_mean_gap": p_mean, "published_max_gap": p_max}
            print(f"against FL-bench as published (curve): mean |diff| {p_mean:.2f}, max |diff| {p_max:.2f} points")
        if gm_pairs:
            gm_lib = entry["gm_curve"][: len(gm_pairs)]
            gm_ours = raysim_points(history, gm_pairs)
            g_mean, g_max = gaps(gm_lib, gm_ours)
            results[method] |= {
                "gm_pairs": gm_pairs,
                "gm_library": gm_lib,
                "gm_raysim": gm_ours,
                "gm_mean_gap": g_mean,
                "gm_max_gap": g_max,
            }
            print(
                f"  GM: mean |diff| {g_mean:.2f}, max |diff| {g_max:.2f} points; per step "
                + " ".join(f"{p['step']}:{a:.1f}/{b:.1f}" for p, a, b in zip(gm_pairs, gm_lib, gm_ours, strict=True))
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
