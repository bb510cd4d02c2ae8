"""Run a YAML file (an experiment, a suite or a sweep) and print its outcome, with the command line's error
and signal handling: what `raysim run` does, and what a Ray job's entrypoint runs (raysim.jobs), so that
neither has to go through the other. Also `raysim pretrain`: AugFL's teacher pretrained ahead of time."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from raysim.credentials import redact, redact_text
from raysim.errors import ConfigError, RayLost, RaysimError, as_raised, sigterm_interrupts

if TYPE_CHECKING:
    from raysim.config import ExperimentConfig
    from raysim.data.dataset import Dataset


def guarded(action: Callable[[], int]) -> int:
    """`action()`'s exit code; an input error is one `error:` line (2), a local Ray lost under the run one
    `error:` line (1), Ctrl-C, SIGTERM or SIGHUP one line saying what became of the run (128 + the signal);
    credentials are redacted from all of them."""
    with sigterm_interrupts():
        try:
            return action()
        except KeyboardInterrupt as caught:
            interrupt = as_raised(caught)
            if isinstance(interrupt, RayLost):
                _say(f"error: {redact_text(str(interrupt))}")
                return 1
            number = getattr(interrupt, "signal_number", signal.SIGINT)
            _say(redact_text(str(interrupt)) or f"interrupted by {signal.Signals(number).name}")
            return 128 + number
        except RaysimError as error:
            _say(f"error: {redact_text(str(error))}")
            return 2


def _say(line: str) -> None:
    """The outcome's line on stderr, unless stderr is gone (the terminal of a SIGHUP was closed): the run is
    marked in MLflow either way, and the exit code stays the signal's (Python exits 120 when it cannot flush the
    standard streams at exit: they are pointed at /dev/null)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - open until the process exits


def run_file(
    path: str | Path,
    overrides: list[str],
    quiet: bool = False,
    resume: str | None = None,
    plugins: list[str] | tuple[str, ...] = (),
) -> int:
    """Run an experiment, a suite (a file with `runs:`) or a sweep (`grid:` / `random:`) and print its outcome;
    `resume`: a stopped suite's or sweep's parent run to continue; `plugins`: imported before the file is validated
    (`--plugin`, besides the file's own `plugins:`)."""
    from raysim.config import is_suite_file, is_sweep_file, load_config

    if is_suite_file(path):
        return run_suite_file(path, overrides, quiet, resume, plugins)
    if is_sweep_file(path):
        return run_sweep_file(path, overrides, quiet, resume, plugins)
    if resume is not None:
        raise ConfigError(f"--resume continues a suite or sweep; {path} is one experiment: use `raysim resume RUN_ID`")
    config = load_config(path, overrides, plugins)
    from raysim.runtime.driver import run_experiment  # after the config: a refused one costs no torch, Ray, MLflow

    result = run_experiment(config, show_progress=not quiet)
    print_run(result)
    return 0


def print_run(result) -> None:
    """The line a finished run ends with (`raysim submit` finds the run id in it)."""
    final = result.summary
    print(
        f"run {result.run_id}: final PM {final['final/pm/acc']:.4f}  GM {final['final/gm/acc']:.4f}  "
        f"HM {final['final/hm/acc']:.4f}  (best PM {final['best/pm/acc']:.4f})"
    )


def run_suite_file(
    path: str | Path,
    overrides: list[str],
    quiet: bool = False,
    resume: str | None = None,
    plugins: list[str] | tuple[str, ...] = (),
) -> int:
    """Exit code 1 when a child failed (the others run to the end)."""
    from raysim.studies.children import failure_lines, resume_command
    from raysim.studies.suite import load_suite, run_suite

    suite = load_suite(path, overrides, plugins)
    command = study_command(path, overrides, plugins)
    result = run_suite(suite, show_progress=not quiet, resume=resume, command=command)
    print(f"suite {suite.name}: parent run {result.parent_run_id} at {redact(result.tracking_uri)}")
    print(f"{'run':24s} {'PM':>7s} {'GM':>7s} {'HM':>7s}   (final accuracy, mean over finished seeds)")
    for name in dict.fromkeys(c.name for c in result.children):
        if not any(c.outcome.finished for c in result.children if c.name == name):
            print(f"{name:24s} {'failed':>7s}")
            continue
        accs = [result.mean_final(name, f"final/{k}/acc") for k in ("pm", "gm", "hm")]
        print(f"{name:24s} " + " ".join(f"{a:7.4f}" for a in accs))
    children = [(c.config, c.outcome) for c in result.children]
    for line in failure_lines("suite", children, resume_command("suite", command, result.parent_run_id)):
        print(line, file=sys.stderr)
    return 1 if result.failed else 0


def run_sweep_file(
    path: str | Path,
    overrides: list[str],
    quiet: bool = False,
    resume: str | None = None,
    plugins: list[str] | tuple[str, ...] = (),
) -> int:
    """Exit code 1 when a trial failed (the others run to the end)."""
    from raysim.studies.children import failure_lines, resume_command
    from raysim.studies.sweep import load_sweep, run_sweep, setting_stats

    sweep = load_sweep(path, overrides, plugins)
    command = study_command(path, overrides, plugins)
    result = run_sweep(sweep, show_progress=not quiet, resume=resume, command=command)
    print(f"sweep {sweep.name}: parent run {result.parent_run_id} at {redact(result.tracking_uri)}")
    print(f"{'setting':32s} {'seeds':>5s} {'PM mean':>8s} {'+/- std':>8s}   (final accuracy)")
    for label, mean, std, count in setting_stats(result.trials, result.outcomes, "final/pm/acc"):
        print(f"{label:32s} {count:5d} {mean:8.4f} {std:8.4f}")
    trials = [(t.config, o) for t, o in zip(result.trials, result.outcomes, strict=True)]
    for line in failure_lines("sweep", trials, resume_command("sweep", command, result.parent_run_id)):
        print(line, file=sys.stderr)
    return 1 if result.failed else 0


def study_command(path: str | Path, overrides: list[str], plugins: list[str] | tuple[str, ...] = ()) -> str:
    """The command line that runs a suite or sweep file with these `--set` overrides (`--tracking-uri` and
    `--experiment` among them, credentials redacted) and `--plugin` modules or files: what continues it, with
    `--resume PARENT`."""
    options = [
        *(part for o in overrides for part in ("--set", redact_text(o))),
        *(part for spec in plugins for part in ("--plugin", spec)),
    ]
    return shlex.join(["raysim", "run", str(path), *options])


def pretrain(
    config: ExperimentConfig, out: Path | None = None, dataset: Dataset | None = None, show_progress: bool = False
) -> Path:
    """`raysim pretrain`: train the teacher of `config` in this process (AugFL's, on the `meta` partition's reserved
    pool, with the recipe of its `algorithm.teacher_*` settings; raysim.algorithms.augfl.teacher.pretraining says
    which and how), write it as a weights file to `out` (default: the cache a run without
    `algorithm.teacher_weights` reads, reused when there) and return its path; a bar on stderr with `show_progress`."""
    from rich.console import Console

    from raysim.algorithms.augfl.teacher import pretraining
    from raysim.runtime.problem import run_server_requests, server_context, torch_threads
    from raysim.seeding import use_kernels
    from raysim.tracking.progress import TrainingBar

    if dataset is None:
        dataset = config.dataset.loaded(config.seed)
    context = server_context(config, dataset)
    bar = TrainingBar(Console(stderr=True)) if show_progress else None
    use_kernels(config.runtime.deterministic)
    try:
        with torch_threads(config.runtime.torch_threads):  # as a run's driver trains it (raysim.runtime.problem)
            return run_server_requests(pretraining(config.algorithm, context, out), context, bar)
    finally:
        if bar is not None:
            bar.close()
