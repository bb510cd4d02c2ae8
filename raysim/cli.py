"""The `raysim` command line: run an experiment, open the MLflow UI, list the algorithms, models and datasets."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

UI_PORT = 5000
"""`raysim ui`'s port unless --port is given (MLflow's own default)"""
DOCS_PORT = 8000
"""`raysim docs`' first port to try unless --port is given"""


def _run(args: argparse.Namespace) -> int:
    from raysim.launch import run_file

    return run_file(args.config, [*args.set, *_tracking_overrides(args)], args.quiet, args.resume, args.plugin)


def _tracking_overrides(args: argparse.Namespace) -> list[str]:
    """`--tracking-uri` and `--experiment` as the `--set` overrides they stand for."""
    overrides = []
    if args.tracking_uri is not None:
        overrides.append(f"tracking.uri={args.tracking_uri}")
    if args.experiment is not None:
        overrides.append(f"tracking.experiment={args.experiment}")
    return overrides


def _config(args: argparse.Namespace) -> int:
    """The resolved, validated config as YAML: every default filled in, credentials redacted. A suite or sweep
    validates every child and shows the first in full and each other setting by what differs from it, or with
    `--child NAME` that child in full."""
    from raysim.config import load_config
    from raysim.errors import ConfigError
    from raysim.studies.family import family_children, family_yaml

    children = family_children(args.config, args.set, args.plugin)
    if children is None:
        if args.child is not None:
            raise ConfigError(f"--child: {args.config} is one experiment, not a suite or sweep")
        print(load_config(args.config, args.set, args.plugin).to_yaml(), end="")
    else:
        print(family_yaml(args.config, children, args.child), end="")
    return 0


def _logs(args: argparse.Namespace) -> int:
    from raysim.jobs import JobError, job_client
    from raysim.jobs import follow as follow_job

    client = job_client(args.address, args.auth_token)
    try:
        if args.follow:
            print(f"job {args.job}: {follow_job(client, args.job)}")
        else:
            print(client.get_job_logs(args.job), end="")
    except RuntimeError as error:
        raise JobError(f"job {args.job}: {str(error).splitlines()[0]}") from None
    return 0


def _table(args: argparse.Namespace) -> int:
    from raysim.errors import ConfigError, check_output
    from raysim.studies.table import DEFAULT_BEST_BY, make_table
    from raysim.tracking.mlflow_writer import resolve_tracking_uri

    if args.best_by is not None and args.at != "best":
        raise ConfigError("--best-by needs --at best (with --at final every value is the last round's)")
    best_by = args.best_by or DEFAULT_BEST_BY
    if args.out:
        check_output(args.out, "--out", "file")
    table = make_table(
        resolve_tracking_uri(args.tracking_uri),
        args.target,
        args.metrics,
        args.at,
        best_by,
        args.std,
        args.over_rounds,
        args.rounds_to,
    )
    text = table.render(args.format)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


def _figure(args: argparse.Namespace) -> int:
    from raysim.errors import check_output
    from raysim.studies.figure import FigureLook, paper_layout, parse_pairs, write_figure
    from raysim.tracking.mlflow_writer import resolve_tracking_uri

    folder = check_output(args.out, "--out", "folder")
    if args.gain_over is not None:
        from raysim.studies.gains import write_gains_figure

        columns = args.columns or ["pm_test_acc"]
        uri = resolve_tracking_uri(args.tracking_uri)
        paths = write_gains_figure(uri, args.target, args.gain_over, folder, columns, args.reference_column)
        print("wrote " + ", ".join(map(str, paths)))
        return 0
    paper = paper_layout(args.width, args.column, args.font_size, args.ncols)
    colors, labels = parse_pairs(args.color, "--color"), parse_pairs(args.label, "--label")
    look = FigureLook(paper, colors, labels, args.title)
    paths = write_figure(resolve_tracking_uri(args.tracking_uri), args.target, folder, args.metrics, args.band, look)
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def _partition(args: argparse.Namespace) -> int:
    from raysim.config import load_config
    from raysim.data.partition_file import is_disjoint
    from raysim.errors import check_output
    from raysim.runtime.problem import save_partition

    check_output(args.out, "--out", "file")
    splits, malicious = save_partition(load_config(args.config, args.set, args.plugin), Path(args.out))
    train, test = [len(s.train) for s in splits], [len(s.test) for s in splits]
    kind = "disjoint" if is_disjoint(splits) else "overlapping"
    print(
        f"wrote {args.out}: {len(splits)} clients, {kind}; per client {min(train)}-{max(train)} training and "
        f"{min(test)}-{max(test)} test samples; attackers: {', '.join(map(str, sorted(malicious))) or 'none'}"
    )
    print(f"replay it with  partition: {{scheme: file, path: {args.out}}}")
    return 0


def _resume(args: argparse.Namespace) -> int:
    if args.target is None:
        _load_plugins(args)  # a --plugin that cannot be imported is refused here too, not ignored
        return _resumable(args.tracking_uri)
    from raysim.launch import print_run
    from raysim.runtime.driver import resume_experiment  # torch, Ray: only to resume, not to list

    print_run(resume_experiment(args.target, args.tracking_uri, show_progress=not args.quiet, plugins=args.plugin))
    return 0


def _resumable(tracking_uri: str | None) -> int:
    """`raysim resume` without a target: the runs that can be continued, and whether their driver is gone."""
    from raysim.tracking.runs import resumable_runs

    runs = resumable_runs(tracking_uri)
    if not runs:
        print("no unfinished run with a checkpoint (runs need tracking.checkpoint_every > 0)")
        return 0
    print(f"{'run id':32s}  {'experiment':16s} {'status':8s} {'started':19s}  driver")
    for run in runs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.started))
        print(f"{run.run_id:32s}  {run.experiment[:16]:16s} {run.status:8s} {started:19s}  {run.driver}")
    print("continue one with `raysim resume RUN_ID`; a RUNNING run whose driver is gone was killed outright")
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    from raysim.config import load_config
    from raysim.errors import check_output
    from raysim.launch import pretrain
    from raysim.models.weights import read_weights

    if args.out is not None:  # refused before the hours of training, not at the rename after them
        check_output(args.out, "--out", "file")
    path = pretrain(load_config(args.config, args.set, args.plugin), args.out, show_progress=not args.quiet)
    _, header = read_weights(path, "--out")
    recipe = header.recipe
    print(
        f"wrote {path}: {header.model}, {header.parameters:,} parameters, {header.dataset} ({header.classes} "
        f"classes), {recipe['epochs']} epochs on {recipe['pool_samples']:,} samples (mean "
        f"loss {recipe['mean_loss']:.4f}, sha256 {header.sha256[:16]}...)"
    )
    print(f"use it with  --set algorithm.teacher_weights={path}")
    return 0


def _ui(args: argparse.Namespace) -> int:
    """The MLflow UI on `--host` (127.0.0.1; another address is warned about): on `--port` (refused in one line
    if taken), else on 5000 or, when that is taken, the next free port, said in one line. The port is settled
    first, before the slow imports."""
    from raysim.tracking.server import (
        ServerSettings,
        check_port,
        exposure_warning,
        in_use_message,
        next_free_port,
        runs_page,
        serve,
    )

    host, port = args.host, args.port
    if args.plugin and not args.config:  # with a config they are imported with it, below
        _load_plugins(args)
    _warn(exposure_warning(host))
    if port is None:
        port = next_free_port(host, UI_PORT)
        if port != UI_PORT:
            print(f"{in_use_message(host, UI_PORT)}: the UI takes port {port}", flush=True)
    else:
        check_port(host, port)
    from raysim.tracking.mlflow_writer import resolve_tracking_uri

    uri, experiment = args.tracking_uri, None
    if args.config:
        from raysim.config import load_config

        tracking = load_config(args.config, extra_plugins=args.plugin).tracking
        uri, experiment = uri or tracking.uri, tracking.experiment
    store = resolve_tracking_uri(uri)
    landing = lambda url: runs_page(url, store, experiment)  # noqa: E731
    if args.compare:
        from raysim.tracking.views import comparison_path

        path = comparison_path(store, args.compare)
        landing = lambda url: url + path  # noqa: E731
    serve(ServerSettings(store, None, host, port), "MLflow UI", landing, port_chosen=args.port is None)


def _docs(args: argparse.Namespace) -> int:
    """The checkout's documentation site (--site, else site/; built first when missing or older than its sources) on
    `--host`, on `--port` (refused in one line if taken) or the first free port from 8000."""
    from raysim import docs_site
    from raysim.tracking.server import check_port, exposure_warning, next_free_port

    host = args.host
    _warn(exposure_warning(host))
    if args.port is None:
        port = next_free_port(host, DOCS_PORT)
    else:
        port = args.port
        check_port(host, port)
    site = args.site or docs_site.ROOT / "site"
    if docs_site.is_stale(site):
        docs_site.build(site)
    docs_site.serve(site, host, port)
    return 0


def _load_plugins(args: argparse.Namespace) -> None:
    """Import the `--plugin` modules and files of a command that reads no config, so that it knows their entries."""
    from raysim import plugins

    plugins.load_all(plugins.resolve(args.plugin, None, "--plugin"))


def _first_line(text: str | None) -> str:
    return next(iter((text or "").strip().splitlines()), "")


def _algorithms(args: argparse.Namespace) -> int:
    """Each `algorithm.name` and the first line of its module's docstring."""
    from raysim.algorithms import ALGORITHMS

    _load_plugins(args)
    for name, cls in ALGORITHMS.items():
        print(f"{name:12s} {_first_line(sys.modules[cls.__module__].__doc__)}")
    return 0


def _models(args: argparse.Namespace) -> int:
    """Each `model.name` and the first line of its factory's docstring."""
    from raysim.models.spec import MODELS

    _load_plugins(args)
    for name, entry in MODELS.items():
        print(f"{name:12s} {_first_line(entry.definition.__doc__)}")
    return 0


def _datasets(args: argparse.Namespace) -> int:
    """Each `dataset.name`: whether its files are here (and where), the layout it reads, how to get it."""
    from raysim.data import DATASETS
    from raysim.data.catalog import default_root, found_at
    from raysim.data.fashion_mnist import CACHE_DIR, DEBIAN_DIR
    from raysim.errors import DataError
    from raysim.registry import defined_by

    _load_plugins(args)
    if args.root and not Path(args.root).expanduser().is_dir():
        raise DataError(f"--root {args.root}: no such folder")
    roots = [Path(args.root).expanduser()] if args.root else []
    roots += [default_root(), CACHE_DIR, DEBIAN_DIR]
    print(f"looked in: {', '.join(str(r) for r in roots)}")
    for name, source in DATASETS.items():
        found = found_at(source, roots)
        where = f"found in {found}" if found else "missing"
        if found == Path("-"):  # nothing to find: raysim's ship with a package (digits), a plugin's make their data
            origin = getattr(defined_by(source), "__module__", "") or ""
            where = "built in" if origin.startswith("raysim.") else f"needs no files (plugin {origin})"
        print(f"{name:14s} {where}: {source.summary()}")
        if found is None:
            print(f"{'':14s}   reads {source.layout}; get it: {source.get}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from raysim.launch import run_sweep_file

    return run_sweep_file(args.sweep, [*args.set, *_tracking_overrides(args)], args.quiet, args.resume, args.plugin)


def _submit(args: argparse.Namespace) -> int:
    from raysim.config import is_sweep_file
    from raysim.jobs import Kind, job_client, submit, wait_for_run_id
    from raysim.jobs import follow as follow_job

    kind: Kind = "sweep" if is_sweep_file(args.config) else "experiment"
    submission = submit(
        kind, args.config, args.set, args.address, args.tracking_uri, args.package, args.auth_token, plugins=args.plugin
    )
    print(f"submitted {kind} job {submission.job_id} to {submission.address}", flush=True)
    if submission.warning:
        print(f"warning: {submission.warning}", file=sys.stderr)
    if not submission.tracking_uri:
        print(
            "warning: no tracking URI (--tracking-uri, tracking.uri or $MLFLOW_TRACKING_URI): the job logs to "
            "sqlite in its temporary working directory",
            file=sys.stderr,
        )
    client = job_client(submission.address, args.auth_token)
    run_id = wait_for_run_id(client, submission.job_id, args.wait)
    print(f"mlflow run {run_id or 'unknown (see the job logs)'} at {submission.tracking_uri or 'job-local sqlite'}")
    if not args.follow:
        return 0
    status = follow_job(client, submission.job_id)
    print(f"job {submission.job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def _jobs(args: argparse.Namespace) -> int:
    from raysim.jobs import RUN_ID, job_client

    client = job_client(args.address, args.auth_token)
    jobs = sorted(client.list_jobs(), key=lambda job: job.start_time or 0)
    if not jobs:
        print(f"no jobs on {client.get_address()}")
        return 0
    print(f"{'job':28s} {'status':10s} {'started':19s}  {'mlflow run':32s}  entrypoint")
    for job in jobs:
        job_id = job.submission_id or job.job_id
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.start_time / 1000)) if job.start_time else "-"
        found = RUN_ID.search(client.get_job_logs(job_id)) if job.submission_id else None
        run_id = found.group(1) if found else "-"
        print(f"{job_id:28s} {job.status.value:10s} {started:19s}  {run_id:32s}  {job.entrypoint}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from raysim.jobs import JobError, job_client

    client = job_client(args.address, args.auth_token)
    try:
        stopped = client.stop_job(args.job)
    except RuntimeError as error:
        raise JobError(f"job {args.job}: {str(error).splitlines()[0]}") from None
    print(f"job {args.job}: {'cancel requested' if stopped else 'already finished'}")
    return 0


def _stop_nodes(args: argparse.Namespace) -> int:
    from raysim.jobs import stop_nodes

    count = stop_nodes(args.temp_dir)
    print(f"stopped {count} Ray processes of the nodes in {args.temp_dir}")
    return 0


def _warn(warning: str | None) -> None:
    if warning:
        print(warning, file=sys.stderr, flush=True)


def _server(args: argparse.Namespace) -> int:
    from raysim.tracking.server import ServerSettings, exposure_warning, serve

    _warn(exposure_warning(args.host))
    destination = None if args.no_artifacts else args.artifacts_destination
    serve(ServerSettings(args.backend_store_uri, destination, args.host, args.port, args.workers))


def _bench(args: argparse.Namespace) -> int:
    from raysim.errors import check_output
    from raysim.studies.bench import WAYS, report, run_bench

    check_output(args.json, "--json", "file")
    _load_plugins(args)
    ways = tuple(args.ways or WAYS)
    results = run_bench(
        args.clients,
        args.rounds,
        args.model,
        args.hosts,
        ways,
        args.host_gpus,
        args.reference_device,
        args.chunk,
        args.eval,
        args.set,
        args.participation,
        args.state,
        args.samples_per_client,
    )
    report(results, args.json)
    return 0


def _cluster_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--address", help="Ray dashboard URL (default: $RAY_ADDRESS if http, else :8265 on 127.0.0.1)")
    command.add_argument(
        "--auth-token", help="Ray cluster token (default: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
    )


def _plugin_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE_OR_FILE",
        help="import this module or .py file first (repeatable): its algorithms, models, datasets, schemes, attacks "
        "and rules join the registries (see docs/extending.md)",
    )


class _Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (examples keep their lines); every option with a default shows it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, [], argparse.SUPPRESS) and "default" not in text
        if shown and action.option_strings:
            default = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
            text += f" (default: {default})"
        return text


RUN_DESCRIPTION = """Run one experiment (a FLAME/FedAPM/FedSLR/AugFL/baseline config), a suite (a file with `runs:`)
or a sweep (`grid:` / `random:`) on a local Ray (or the cluster of runtime.address / $RAY_ADDRESS), logging to MLflow
(tracking.uri, default sqlite:///mlflow.db here). Ctrl-C marks the run KILLED; `raysim resume` continues it.

examples:
  raysim run configs/quickstart.yaml
  raysim run configs/quickstart.yaml --set rounds=5 --set partition.q=3 --experiment tryout
  raysim run configs/quickstart.yaml --set partition.scheme=dirichlet --set partition.beta=0.3
  raysim run configs/paper/suites/flame_table3_fmnist.yaml --tracking-uri http://127.0.0.1:5000
  raysim config configs/quickstart.yaml --set algorithm.name=fedavg   # see what would run
"""


def parser() -> argparse.ArgumentParser:
    from raysim import __version__

    top = argparse.ArgumentParser(prog="raysim", description=__doc__, formatter_class=_Help)
    top.add_argument("--version", action="version", version=f"raysim {__version__}")
    subparsers = top.add_subparsers(dest="command", required=True)

    class Commands:
        """The subcommands, each with the same help formatter."""

        @staticmethod
        def add_parser(name: str, **options) -> argparse.ArgumentParser:
            return subparsers.add_parser(name, formatter_class=_Help, **options)

    commands = Commands()
    run = commands.add_parser(
        "run",
        help="run an experiment, a suite (a file with `runs:`) or a sweep (`grid:`/`random:`) from YAML",
        description=RUN_DESCRIPTION,
    )
    run.add_argument("config", help="path of the experiment, suite or sweep YAML")
    run.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config value")
    run.add_argument("--tracking-uri", help="MLflow tracking URI (sets tracking.uri)")
    run.add_argument("--experiment", help="MLflow experiment name (sets tracking.experiment)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument(
        "--resume",
        metavar="PARENT_RUN",
        help="suite or sweep: continue this stopped parent run (finished children "
        "are kept, unfinished ones continue from their checkpoints or start again, missing ones start)",
    )
    _plugin_option(run)
    run.set_defaults(handler=_run)
    config = commands.add_parser(
        "config",
        help="print the resolved, validated config (defaults filled in) without running it",
        description="Load an experiment YAML with its --set overrides, validate it as `raysim run` would, and print "
        "every setting. Of a suite or sweep: every child is validated; the first is shown in full, every other "
        "setting by the keys in which it differs. Example: raysim config configs/quickstart.yaml --set "
        "partition.scheme=iid",
    )
    config.add_argument("config", help="experiment, suite or sweep YAML")
    config.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a value")
    config.add_argument("--child", metavar="NAME", help="of a suite or sweep: show this child in full (its run name)")
    _plugin_option(config)
    config.set_defaults(handler=_config)
    table = commands.add_parser(
        "table",
        help="the result table of a suite or sweep (mean +/- std over seeds)",
        description="One row per setting of a suite or sweep (parent run id), or per configuration of an "
        "experiment's runs (experiment name); one column per metric; each cell the mean +/- std over the seeds "
        "(sample or population) of each seed's value at the final round, at its best round (where --best-by peaks; "
        "every metric at that round), or each metric's own max or min over rounds; optional columns give the "
        "rounds to reach a target. Examples: raysim table 3f2c... --at best --metrics pm/acc gm/acc hm/acc "
        "pm/loss_var --format latex --out table.tex; FedAPM's Table 3: raysim table 3f2c... --metrics pm/acc pm/f1 "
        "pm/auc --over-rounds max --std population --rounds-to 'pm/train_loss<=0.5'",
    )
    table.add_argument("target", help="parent run id of a suite or sweep, or an experiment name")
    table.add_argument("--metrics", nargs="+", default=None, help="logged metric keys (default: pm/acc gm/acc hm/acc)")
    table.add_argument(
        "--at", choices=["final", "best"], default="final", help="the last round (default), or each run's best"
    )
    table.add_argument(
        "--best-by",
        metavar="METRIC",
        help="with --at best: the metric whose best round (highest; lowest for losses "
        "and variances) every metric is taken at (default: pm/acc)",
    )
    table.add_argument(
        "--over-rounds",
        choices=["final", "max", "min"],
        default="final",
        help="with --at final: each seed's value "
        "is the final round's (default), or each metric's own max (min, for a loss) over rounds 1 to the last, as "
        "FedAPM's authors aggregate",
    )
    table.add_argument(
        "--std",
        choices=["sample", "population"],
        default="sample",
        help="the std over seeds: sample (ddof 1, default) or population (np.std, ddof 0, as FedAPM's authors)",
    )
    table.add_argument(
        "--rounds-to",
        action="append",
        default=[],
        metavar="METRIC<=VALUE",
        help="add a column: the first round at "
        "which each seed's curve meets the target (<=, >=, < or >), mean +/- std over the seeds that do, '>T' for "
        "those that do not by their last round T; repeatable. Example: --rounds-to 'pm/train_loss<=0.5'",
    )
    table.add_argument("--format", choices=["markdown", "csv", "latex"], default="markdown", help="default: markdown")
    table.add_argument("--out", help="write the table to this file instead of printing it")
    table.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
    table.set_defaults(handler=_table)

    figure = commands.add_parser(
        "figure",
        help="a suite's or sweep's curves: mean over seeds per round with a band, one panel per metric",
        description="Draw each setting's curve of each metric (mean over its seeds per round, with a band of +/- "
        "the sample std or the seeds' min-max), one panel per metric, read from MLflow like `raysim table`; "
        "written as curves.png, curves.pdf and curves.svg. Example: raysim figure 3f2c... --metrics pm/acc gm/acc "
        "pm/loss_var --out figures/",
    )
    figure.add_argument("target", help="parent run id of a suite or sweep, or an experiment name")
    figure.add_argument("--metrics", nargs="+", default=None, help="logged metric keys (default: pm/acc gm/acc hm/acc)")
    figure.add_argument(
        "--band",
        choices=["std", "minmax"],
        default="std",
        help="the band around the mean: +/- sample std over seeds, or their min to max",
    )
    figure.add_argument(
        "--gain-over",
        metavar="REFERENCE",
        help="instead of curves, violins of each client's accuracy gain over REFERENCE (a run id, or the name of one "
        "of the suite's runs, e.g. fedavg) from the two runs' per-client tables (FedSLR's Fig. 3), as gains.{png,pdf,"
        "svg}; TARGET is then a run or a suite's parent (each of its runs but the reference)",
    )
    figure.add_argument(
        "--columns",
        nargs="+",
        default=None,
        help="with --gain-over: the per-client columns compared (default: pm_test_acc)",
    )
    figure.add_argument(
        "--reference-column",
        default="gm_test_acc",
        help="with --gain-over: the reference's per-client column (default: gm_test_acc, FedAvg's one model)",
    )
    figure.add_argument(
        "--column",
        choices=["single", "double"],
        help="for a paper: the figure exactly one column (3.5 in) or the page (7.16 in) wide, its text 8 pt, the "
        "legend below the panels, no title",
    )
    figure.add_argument("--width", type=float, help="for a paper: the figure's width in inches (instead of --column)")
    figure.add_argument("--font-size", type=float, help="for a paper: every text's size in points (default: 8)")
    figure.add_argument(
        "--ncols", type=int, help="for a paper: panels per row, the others in further rows (default: all in one row)"
    )
    figure.add_argument(
        "--color",
        action="append",
        metavar="SETTING=COLOUR",
        help="a setting's colour (#rrggbb or a matplotlib name), repeatable; default: its colour in MLflow's charts",
    )
    figure.add_argument(
        "--label", action="append", metavar="SETTING=TEXT", help="a setting's legend label, repeatable (fedavg=FedAvg)"
    )
    figure.add_argument("--title", help="the figure's title ('' for none; default: the study and its seeds on screen)")
    figure.add_argument("--out", default=".", help="folder for curves.{png,pdf,svg} (default: the current one)")
    figure.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
    figure.set_defaults(handler=_figure)
    partition = commands.add_parser(
        "partition",
        help="write a config's partition as Parquet (replay: partition: {scheme: file, path: FILE})",
        description="Partition the config's dataset as a run would (same seed, same clients, same attackers) and "
        "write one row per client (train/test/val sample indices, noise level, malicious flag) as Parquet. "
        "Example: raysim partition configs/quickstart.yaml --out q2.parquet",
    )
    partition.add_argument("config", help="experiment YAML")
    partition.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a value")
    partition.add_argument("--out", required=True, help="the Parquet file to write")
    _plugin_option(partition)
    partition.set_defaults(handler=_partition)
    resume = commands.add_parser("resume", help="continue a run from its last checkpoint (same MLflow run)")
    resume.add_argument(
        "target", nargs="?", help="MLflow run id, or a checkpoint folder; none: list the runs that can be resumed"
    )
    resume.add_argument("--tracking-uri", help="where to look the run id up (default: $MLFLOW_TRACKING_URI or sqlite)")
    resume.add_argument("--quiet", action="store_true", help="no progress bar")
    resume.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE_OR_FILE",
        help="import this module or .py file first (repeatable): a checkpoint whose config lists plugins is resumed "
        "only with each of them given here, since resuming imports nothing the checkpoint names",
    )
    resume.set_defaults(handler=_resume)
    pretrain = commands.add_parser(
        "pretrain",
        help="train the config's teacher (AugFL's pretrained model) and write it as a versioned weights file",
        description="Train the teacher of the config's algorithm on the first pool the meta partition keeps back "
        "from every client, with the recipe of its algorithm.teacher_* settings (default: the AugFL authors', 240 "
        "epochs of SGD), and write its parameters with a header and their sha256 checksum, atomically. Runs load it "
        "with algorithm.teacher_weights=FILE. Example: raysim pretrain configs/augfl.yaml --out teacher.npz --set "
        "algorithm.teacher_epochs=3",
    )
    pretrain.add_argument("config", help="experiment YAML with partition.scheme = meta")
    pretrain.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a value")
    pretrain.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the weights file to write (default: the cache a run without algorithm.teacher_weights reads, "
        "$RAYSIM_CACHE/teacher, ~/.cache/raysim/teacher; a file already there is reused)",
    )
    pretrain.add_argument("--quiet", action="store_true", help="no progress bar")
    _plugin_option(pretrain)
    pretrain.set_defaults(handler=_pretrain)
    ui = commands.add_parser("ui", help="start the MLflow UI on 127.0.0.1 (or --host) for the tracking store")
    ui.add_argument(
        "--host", default="127.0.0.1", help="bind address; another than loopback (a shared machine) is warned about"
    )
    ui.add_argument("--config", help="take the tracking URI from this experiment config")
    ui.add_argument(
        "--tracking-uri", help="explicit tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)"
    )
    ui.add_argument("--port", type=int, help=f"port, refused if taken (default: {UI_PORT}, or the next free one)")
    ui.add_argument(
        "--compare", metavar="PARENT_RUN", help="open on this suite's or sweep's children, grouped by setting"
    )
    _plugin_option(ui)
    ui.set_defaults(handler=_ui)
    docs = commands.add_parser(
        "docs", help="serve the documentation site on 127.0.0.1 (built first when missing or stale) until Ctrl-C"
    )
    docs.add_argument("--host", default="127.0.0.1", help="bind address; another than loopback is warned about")
    docs.add_argument("--port", type=int, help=f"port, refused if taken (default: the first free one from {DOCS_PORT})")
    docs.add_argument(
        "--site", type=Path, help="the built site to serve, rebuilt if stale (default: site/ of the checkout)"
    )
    docs.set_defaults(handler=_docs)
    bench = commands.add_parser(
        "bench", help="time a FLAME round: plain torch loop vs raysim sequential vs vectorized (table and JSON)"
    )
    bench.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000], help="client counts")
    bench.add_argument("--rounds", type=int, default=5, help="rounds per measurement (at least 3)")
    bench.add_argument("--model", choices=["mlr", "mlp", "cnn"], default="mlp", help="the clients' model")
    bench.add_argument("--hosts", type=int, default=None, help="raysim host actors (default: one per CPU)")
    bench.add_argument(
        "--host-gpus",
        type=float,
        nargs="+",
        default=[0.0],
        help="GPUs per raysim host actor; several values measure each (e.g. 0.25 0.5 1)",
    )
    bench.add_argument("--reference-device", choices=["cpu", "cuda"], default="cpu", help="the reference loop's")
    bench.add_argument(
        "--chunk", type=int, default=None, help="clients the vectorized way trains together (runtime.vectorize_chunk)"
    )
    bench.add_argument(
        "--ways", nargs="+", choices=["reference", "sequential", "vectorized"], help="default: all three"
    )
    bench.add_argument(
        "--eval", action="store_true", help="evaluate every client after every round and time it apart from training"
    )
    bench.add_argument(
        "--participation", type=float, default=1.0, help="fraction of the clients a round (clients.fraction)"
    )
    bench.add_argument(
        "--state",
        choices=["auto", "hosts", "memory", "disk"],
        default="auto",
        help="where client state lives (runtime.state_store); the reference loop keeps it in files with memory or "
        "disk, or with --participation below 1",
    )
    bench.add_argument(
        "--samples-per-client",
        type=int,
        default=None,
        help="images each client draws for itself (partition.samples_per_client; default 10 past 10,000 clients)",
    )
    bench.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a value of the benchmark's config (e.g. runtime.state_memory_mb=2000, algorithm.name=fedavg)",
    )
    bench.add_argument("--json", type=Path, default=Path("bench.json"), help="where to write the results")
    _plugin_option(bench)
    bench.set_defaults(handler=_bench)
    datasets = commands.add_parser(
        "datasets", help="list the datasets: which are on this machine, the layout each reads, how to get it"
    )
    datasets.add_argument("--root", default=None, help="also look here (a dataset.root)")
    _plugin_option(datasets)
    datasets.set_defaults(handler=_datasets)
    algorithms = commands.add_parser("algorithms", help="list the registered algorithms")
    models = commands.add_parser("models", help="list the registered models")
    _plugin_option(models)
    models.set_defaults(handler=_models)
    _plugin_option(algorithms)
    algorithms.set_defaults(handler=_algorithms)
    sweep = commands.add_parser("sweep", help="run a sweep (grid / random draws x seeds) as concurrent trials")
    sweep.add_argument("sweep", help="path of the sweep YAML")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override the base")
    sweep.add_argument("--tracking-uri", help="MLflow tracking URI of the parent and every trial (sets tracking.uri)")
    sweep.add_argument("--experiment", help="MLflow experiment name (sets tracking.experiment)")
    sweep.add_argument("--quiet", action="store_true", help="no per-trial lines")
    sweep.add_argument("--resume", metavar="PARENT_RUN", help="continue this stopped sweep's parent run")
    _plugin_option(sweep)
    sweep.set_defaults(handler=_sweep)
    submit = commands.add_parser("submit", help="submit an experiment or sweep YAML as a Ray job")
    submit.add_argument("config", help="experiment or sweep YAML (shipped with the job)")
    submit.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a value")
    submit.add_argument("--tracking-uri", help="MLflow URI for the job (default: tracking.uri, $MLFLOW_TRACKING_URI)")
    submit.add_argument("--package", action="store_true", help="use the raysim installed on the cluster, not ./")
    submit.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    submit.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the MLflow run id")
    _cluster_options(submit)
    _plugin_option(submit)
    submit.set_defaults(handler=_submit)
    jobs = commands.add_parser("jobs", help="list the cluster's jobs and their status")
    _cluster_options(jobs)
    jobs.set_defaults(handler=_jobs)
    logs = commands.add_parser("logs", help="print a job's logs (--follow: stream them until it ends)")
    logs.add_argument("job", help="the job (submission) id")
    logs.add_argument("--follow", action="store_true", help="stream the logs until the job ends")
    _cluster_options(logs)
    logs.set_defaults(handler=_logs)
    cancel = commands.add_parser("cancel", help="cancel a submitted job (its run is marked KILLED)")
    cancel.add_argument("job", help="the job (submission) id")
    _cluster_options(cancel)
    cancel.set_defaults(handler=_cancel)
    stop_nodes = commands.add_parser(
        "stop-nodes", help="stop the Ray nodes started here with `ray start --temp-dir DIR`, and nothing else"
    )
    stop_nodes.add_argument("temp_dir", help="the --temp-dir the nodes were started with")
    stop_nodes.set_defaults(handler=_stop_nodes)
    server = commands.add_parser("server", help="start an MLflow tracking server (database + artifact store)")
    server.add_argument("--backend-store-uri", default="sqlite:///mlflow.db", help="sqlite:///... or postgresql://...")
    server.add_argument("--artifacts-destination", default="./mlartifacts", help="artifact store (dir or s3://...)")
    server.add_argument("--no-artifacts", action="store_true", help="do not serve artifacts")
    server.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to let cluster nodes reach it)")
    server.add_argument("--port", type=int, default=5000, help="port to listen on")
    server.add_argument("--workers", type=int, default=1, help="server worker processes")
    server.set_defaults(handler=_server)
    return top


def _hide_credentials_from_process_table() -> None:
    """A password typed on the command line (`--tracking-uri http://user:pw@host`) is redacted from this process's
    command line as the system shows it (`ps`, to every user of the machine) and as Ray records it for a driver
    (a job's entrypoint, kept in a cluster's job table and shown by its dashboard). Ray's own process-title
    setter rewrites it; the command line in MLflow is redacted where it is stored (raysim.tracking)."""
    import shlex

    from raysim.credentials import has_credentials, redact_text

    if any(has_credentials(argument) for argument in sys.argv):
        from ray._raylet import setproctitle  # type: ignore[attr-defined]  # Ray's _raylet.pyi leaves it out

        setproctitle(redact_text(shlex.join(sys.argv)))


def _exit_without_teardown(code: int) -> None:
    """End the process with `code` as any exit does (threads joined, exit handlers run: Ray's, MLflow's, logging's;
    output flushed) but without the interpreter's teardown of every module, which frees torch's, MLflow's and Ray's
    objects one by one: about a second of CPU on the way out of every `raysim run`, after its run has ended (issue 49,
    section 3). An interpreter without CPython's two steps (`threading._shutdown`, `atexit._run_exitfuncs`) returns,
    and exits as usual."""
    import atexit
    import contextlib
    import threading

    join_threads = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or run_exit_handlers is None:
        return
    join_threads()
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, a stream closed: as an exit ignores them
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Errors of input are one `error:` line (exit 2); Ctrl-C and SIGTERM one line saying what became of the
    run (exit 128 + signal); see raysim.launch.guarded. With `argv` None (the `raysim` command) the process ends
    here once the command is done (`_exit_without_teardown`); with a list (from Python) it returns."""
    from raysim.launch import guarded

    if argv is None:
        _hide_credentials_from_process_table()
    args = parser().parse_args(argv)
    try:
        code = guarded(lambda: args.handler(args))
    except BrokenPipeError:  # `raysim datasets | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    if argv is None:
        _exit_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
