"""A/B: the same workloads on two commits, alternately, in one window; each figure's ratio HEAD/BASE with its spread.

    python benchmarks/ab.py BASE [HEAD] [--workloads fedavg flame] [--repeats 3] [--warmup 1] [--json ab.json]

BASE and HEAD are git revisions; HEAD left out is the working tree as it is (uncommitted changes included). Each
revision gets a git worktree under /tmp/ab/<sha> (removed at the end unless `--keep`); nothing is installed: every
run is this venv's Python with the side's tree first on PYTHONPATH and its folder as the working directory, so the
side's `raysim` is imported by the driver and by Ray's workers (both checked once per side before the runs, and in
every run for each Ray process's environment). Each run is a fresh process (its memory never counts in the next).

Workloads (issue 49), 1,000 MLP clients on Fashion-MNIST IID, full participation, vectorized:

- `fedavg`: configs/fedavg.yaml of the side's tree, `partition={scheme: iid}`, 2 hosts, 6 rounds;
- `flame`: `raysim bench`'s FLAME workload (lambda 1, rho 0.1, H = 1, batch 100, lr 0.01, one host per CPU,
  evaluation before round 1 and after the last), 4 rounds.

Figures of a run: `s/round` (median of the gaps between round ends after the first round, the last round left out
when it evaluates alone, as `raysim bench` measures), `start-up s` (to the end of round 1 minus round 1's own
`time/round`) and `peak RSS MiB` (the whole process tree, raysim.studies.procmem). Each run also prints the CPU
seconds a round costs the Ray workers, the driver and Ray's own processes (they move far less with the machine's load
than wall time: the figure to bisect with) and the run's time/clients, time/aggregation, time/evaluation. The order
alternates each
repetition (A B, then B A, ...) so that a machine getting busier slows both sides alike; `--warmup` runs per side
and workload are not counted (numba compiles into each tree's own cache on its first run). The table gives each
side's median and the median of the per-repetition ratios HEAD/BASE with their min-max: read a ratio as different
from 1 only where its whole range is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKTREES = Path("/tmp/ab")
WORKTREE = "worktree"
"""The side name of HEAD left out: the working tree at REPO, as it is."""

WORKLOADS: dict[str, dict[str, int]] = {
    "fedavg": {"clients": 1000, "rounds": 6},
    "flame": {"clients": 1000, "rounds": 4},
}
FIGURES = ("s/round", "start-up s", "peak RSS MiB")
CPU = ("workers CPU s", "driver CPU s", "Ray CPU s")
"""CPU seconds a measured round costs the hosts and coordinator, the driver, and Ray's own processes."""
DETAIL = ("time/clients", "time/aggregation", "time/evaluation")
"""The run's own timings (medians over the measured rounds), printed per run to tell where a difference lies."""
RAY_DAEMONS = ("ray::RuntimeEnv", "ray::Dashboard")
"""Ray's agents (their names as /proc's comm cuts them): started with an environment of their own, import no raysim."""


@dataclass(frozen=True)
class Row:
    """One line of the A/B table: a figure's medians on both sides and the per-repetition ratios' median and range."""

    workload: str
    figure: str
    base: float
    head: float
    ratio: float
    ratio_min: float
    ratio_max: float
    repetitions: int


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; `--rounds`/`--clients` override every chosen workload's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("base", metavar="BASE", help="git revision to compare against (e.g. 67f97c3)")
    parser.add_argument(
        "head", metavar="HEAD", nargs="?", default=None, help="git revision (default: the working tree)"
    )
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per side and workload")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs per side and workload first")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every workload (at least 3)")
    parser.add_argument("--clients", type=int, default=None, help="clients of every workload")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures and the table here")
    parser.add_argument("--keep", action="store_true", help="keep the worktrees under /tmp/ab")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: 0 or more")
    if args.rounds is not None and args.rounds < 3:
        parser.error(f"--rounds {args.rounds}: at least 3 (the first warms up, the last evaluates)")
    if args.clients is not None and args.clients < 1:
        parser.error(f"--clients {args.clients}: at least 1")
    return args


def table_rows(runs: Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]], base: str, head: str) -> list[Row]:
    """`runs[side][workload]` is one figures dict per repetition, in the order they ran; repetition i of HEAD is
    paired with repetition i of BASE (they ran side by side) for the ratios."""
    rows = []
    for workload in runs[base]:
        base_runs, head_runs = runs[base][workload], runs[head].get(workload, [])
        pairs = list(zip(base_runs, head_runs, strict=False))
        if not pairs:
            continue
        for figure in FIGURES:
            ratios = [h[figure] / b[figure] for b, h in pairs]
            rows.append(
                Row(
                    workload,
                    figure,
                    statistics.median(b[figure] for b in base_runs),
                    statistics.median(h[figure] for h in head_runs),
                    statistics.median(ratios),
                    min(ratios),
                    max(ratios),
                    len(pairs),
                )
            )
    return rows


def markdown(rows: Sequence[Row], base: str, head: str) -> str:
    """The table as Markdown (what goes into a note)."""
    lines = [
        f"| workload | figure | {base} median | {head} median | ratio HEAD/BASE | min-max | n |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        digits = ".3f" if row.figure == "s/round" else ".0f" if row.figure == "peak RSS MiB" else ".1f"
        lines.append(
            f"| {row.workload} | {row.figure} | {row.base:{digits}} | {row.head:{digits}} | {row.ratio:.2f} | "
            f"{row.ratio_min:.2f}-{row.ratio_max:.2f} | {row.repetitions} |"
        )
    return "\n".join(lines)


def round_seconds(ends: Sequence[float], last_evaluates: bool) -> float:
    """Median gap between round ends after the first round; the last round left out when it alone evaluates."""
    used = list(ends[:-1]) if last_evaluates and len(ends) > 2 else list(ends)
    gaps = [b - a for a, b in zip(used, used[1:], strict=False)]
    return statistics.median(gaps) if gaps else float("nan")


# The side's process: imports the side's raysim (only APIs every measured commit has).


def _config_tree(workload: str, clients: int, rounds: int, root: Path, folder: Path) -> dict:
    tracking = {"uri": f"sqlite:///{folder}/mlflow.db", "experiment": "ab"}
    if workload == "fedavg":
        import yaml

        tree = yaml.safe_load((root / "configs" / "fedavg.yaml").read_text())
        tree["partition"] = {"scheme": "iid"}
        tree["clients"] = {"count": clients}
        tree["rounds"] = rounds
        tree["runtime"] = {**tree.get("runtime", {}), "num_hosts": 2, "client_training": "vectorized"}
        tree["tracking"] = {**tree.get("tracking", {}), **tracking}
        return tree
    return {
        "algorithm": {"name": "flame", "lambda": 1.0, "rho": 0.1, "epochs": 1, "lr": 0.01, "batch_size": 100},
        "dataset": {"name": "fashion_mnist"},
        "partition": {"scheme": "iid"},
        "model": {"name": "mlp"},
        "clients": {"count": clients},
        "rounds": rounds,
        "seed": 1,
        "runtime": {"num_hosts": None, "client_training": "vectorized"},
        "tracking": {**tracking, "eval_every": rounds},
    }


def _ray_pythonpaths() -> dict[str, str]:
    """PYTHONPATH of every Ray worker below this one (from /proc; not Ray's agents), keyed by `name[pid]`."""
    from raysim.studies.procmem import descendants

    found = {}
    for pid in descendants(os.getpid())[1:]:
        try:
            title = Path(f"/proc/{pid}/comm").read_text().strip()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if title.startswith("ray::") and not title.startswith(RAY_DAEMONS):
            values = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"PYTHONPATH=")]
            found[f"{title}[{pid}]"] = values[0] if values else ""
    return found


def _tree_cpu() -> tuple[float, float, float]:
    """CPU seconds (user + system) so far of the Ray workers below this process (hosts, coordinator), of this
    process (the driver) and of the rest of its tree (Ray's daemons and agents), from /proc."""
    from raysim.studies.procmem import descendants

    tick = os.sysconf("SC_CLK_TCK")
    workers = driver = rest = 0.0
    for pid in descendants(os.getpid()):
        try:
            title = Path(f"/proc/{pid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick
        if pid == os.getpid():
            driver += seconds
        elif title.startswith("ray::") and not title.startswith(RAY_DAEMONS):
            workers += seconds
        else:
            rest += seconds
    return workers, driver, rest


def child_measure(workload: str, clients: int, rounds: int, root: Path) -> dict[str, float]:
    """One run of `workload` with the side's raysim; its figures."""
    import raysim

    if not Path(raysim.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"raysim imported from {raysim.__file__}, not from {root}")
    from raysim.config import validate_config
    from raysim.runtime.driver import run_experiment
    from raysim.studies.procmem import PeakMemory, wait_for_children

    with tempfile.TemporaryDirectory() as folder:
        config = validate_config(_config_tree(workload, clients, rounds, root, Path(folder)))
        ends: list[float] = []
        paths: dict[str, str] = {}

        cpu: list[tuple[float, float, float]] = []

        def inspect(round_index: int, simulation: object) -> None:
            ends.append(time.perf_counter())
            cpu.append(_tree_cpu())
            if round_index == 0:
                paths.update(_ray_pythonpaths())

        with PeakMemory() as memory:
            start = time.perf_counter()
            result = run_experiment(config, show_progress=False, inspect=inspect)
        wait_for_children()
    wrong = {name: path for name, path in paths.items() if path.split(os.pathsep)[0] != str(root)}
    if not paths or wrong:
        raise SystemExit(f"Ray processes without {root} first on PYTHONPATH: {wrong or 'none found'}")
    last_evaluates = config.tracking.eval_every > 1
    figures = {
        "s/round": round_seconds(ends, last_evaluates),
        "start-up s": ends[0] - start - result.history[1]["time/round"],
        "peak RSS MiB": memory.peak_mib,
    }
    measured = range(2, rounds if last_evaluates else rounds + 1)  # the rounds s/round measures
    for index, key in enumerate(CPU):
        figures[key] = statistics.median(cpu[step - 1][index] - cpu[step - 2][index] for step in measured)
    for key in DETAIL:
        values = [result.history[step][key] for step in measured if key in result.history.get(step, {})]
        if values:
            figures[key] = statistics.median(values)
    return figures


def child_where(root: Path) -> dict[str, str]:
    """Where the side's raysim comes from in this process and in a Ray worker (a fresh local Ray)."""
    import ray

    import raysim

    ray.init(num_cpus=1, include_dashboard=False, address="local", logging_level="ERROR")
    try:

        @ray.remote
        def where() -> str:
            import raysim

            return raysim.__file__

        worker = ray.get(where.remote())
    finally:
        ray.shutdown()
    return {"driver": raysim.__file__, "worker": worker}


# The A/B driver: worktrees, alternating runs, the table.


def _git(*arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def side_root(revision: str | None) -> tuple[str, Path]:
    """(name, tree) of a side: a worktree of `revision` under /tmp/ab (made if missing), or the working tree."""
    if revision is None:
        return WORKTREE, REPO
    sha = _git("rev-parse", "--verify", f"{revision}^{{commit}}")
    tree = WORKTREES / sha[:12]
    if not (tree / ".git").exists():
        WORKTREES.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--detach", str(tree), sha)
    return sha[:12], tree


def run_side(root: Path, mode: str, *arguments: str) -> dict:
    """Run this script's `--child MODE` in a fresh process of this venv with `root` first on PYTHONPATH."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, str(root), out.name, *arguments]
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{mode} in {root} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def child_main(argv: Sequence[str]) -> None:
    mode, root, out = argv[0], Path(argv[1]).resolve(), Path(argv[2])
    if mode == "where":
        found: dict = child_where(root)
    else:
        clients, rounds = int(argv[3]), int(argv[4])
        found = child_measure(mode, clients, rounds, root)
    out.write_text(json.dumps(found))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    (base, base_root), (head, head_root) = side_root(args.base), side_root(args.head)
    sides = {base: base_root, head: head_root}
    try:
        for name, root in sides.items():
            where = run_side(root, "where")
            wrong = [k for k, path in where.items() if not Path(path).resolve().is_relative_to(root)]
            if wrong:
                raise SystemExit(f"{name}: raysim of the {', '.join(wrong)} is not {root}'s: {where}")
            print(f"{name}: raysim from {where['driver']} (driver), {where['worker']} (Ray worker)", flush=True)
        runs: dict[str, dict[str, list[dict[str, float]]]] = {name: {w: [] for w in args.workloads} for name in sides}
        for repetition in range(args.warmup + args.repeats):
            for index, workload in enumerate(args.workloads):
                order = [base, head] if (repetition + index) % 2 == 0 else [head, base]
                clients = args.clients or WORKLOADS[workload]["clients"]
                rounds = args.rounds or WORKLOADS[workload]["rounds"]
                for name in order:
                    figures = run_side(sides[name], workload, str(clients), str(rounds))
                    measured = repetition >= args.warmup
                    if measured:
                        runs[name][workload].append(figures)
                    shown = ", ".join(f"{k} {v:.3f}" for k, v in figures.items())
                    print(f"{'run' if measured else 'warm-up'} {repetition}: {workload} {name}: {shown}", flush=True)
        rows = table_rows(runs, base, head)
        print(markdown(rows, base, head))
        if args.json is not None:
            payload = {"base": base, "head": head, "runs": runs, "table": [asdict(row) for row in rows]}
            args.json.write_text(json.dumps(payload, indent=2))
    finally:
        if not args.keep:
            for root in sides.values():
                if root != REPO:
                    _git("worktree", "remove", "--force", str(root))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
    else:
        main()
