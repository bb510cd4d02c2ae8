"""The `raysim` command line: run an experiment, open the MLflow UI, list the algorithms."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from raysim.errors import RaysimError


def _run(args: argparse.Namespace) -> int:
    from raysim.config import load_config
    from raysim.runtime.driver import run_experiment

    config = load_config(args.config, args.set)
    result = run_experiment(config, show_progress=not args.quiet)
    final = result.summary
    print(
        f"run {result.run_id}: final PM {final['final/pm/acc']:.4f}  GM {final['final/gm/acc']:.4f}  "
        f"HM {final['final/hm/acc']:.4f}  (best PM {final['best/pm/acc']:.4f})"
    )
    return 0


def _ui(args: argparse.Namespace) -> int:
    from raysim.tracking.mlflow_writer import resolve_tracking_uri

    uri = args.tracking_uri
    if uri is None and args.config:
        from raysim.config import load_config

        uri = load_config(args.config).tracking.uri
    uri = resolve_tracking_uri(uri)
    print(f"MLflow UI for {uri} on http://127.0.0.1:{args.port}", flush=True)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--workers",
        "1",
    ]
    return subprocess.call(command, env=env)


def _algorithms(args: argparse.Namespace) -> int:
    from raysim.algorithms import REGISTRY

    for name, cls in REGISTRY.items():
        summary = (cls.__module__ and sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        print(f"{name:12s} {summary}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="raysim", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run an experiment from a YAML config")
    run.add_argument("config", help="path of the experiment YAML")
    run.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config value")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(handler=_run)
    ui = commands.add_parser("ui", help="start the MLflow UI on 127.0.0.1 for the tracking store")
    ui.add_argument("--config", help="take the tracking URI from this experiment config")
    ui.add_argument(
        "--tracking-uri", help="explicit tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)"
    )
    ui.add_argument("--port", type=int, default=5000)
    ui.set_defaults(handler=_ui)
    algorithms = commands.add_parser("algorithms", help="list the registered algorithms")
    algorithms.set_defaults(handler=_algorithms)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.handler(args)
    except RaysimError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
