"""Plugins: a researcher's own algorithm, model and dataset, kept outside the package (in a temporary folder), come in
through the same registries as raysim's own.

docs/extending.md runs as written: its files are saved into a folder, its math test passes there and its commands
(`raysim ... --plugin FILE`) run there. The same three plugins also run listed in a config (`plugins:`) and installed
as a real package with an entry point (`raysim submit` on a local cluster: tests/system/test_cluster.py). A plugin that
cannot be imported is one error line before Ray starts; a misspelled name of every kind gets a "did you mean".
Whatever imports a plugin runs in a subprocess, so this test process's registries stay as raysim ships them.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.support.cli import HOSTS_IN_PROCESS
from tests.support.experiments import tiny_config
from tests.support.one_process import raysim_commands
from tests.support.pages import PAGE, ROOT, page_files
from tests.support.stores import fresh_store

RUN_MARKER = "<!-- test: plugin-run -->"


RUN_LINE = re.compile(r"^run [0-9a-f]{32}: final PM ", re.M)


PLUGIN_FILES = ("fedavgm.py", "tiny_cnn.py", "csv_source.py")


def page_commands() -> list[str]:
    """The ```bash blocks marked to run, in page order: the math test, then each example's commands (the docs test,
    tests/system/test_docs.py, leaves the blocks after this marker to this file)."""
    return [part.split("```bash\n", 1)[1].split("\n```", 1)[0] for part in PAGE.read_text().split(RUN_MARKER)[1:]]


def write_page(folder: Path) -> Path:
    """The page's files in `folder`, with the checkout's .venv linked in (the page's commands run from a checkout)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in page_files().items():
        (folder / name).write_text(text)
    (folder / ".venv").symlink_to(ROOT / ".venv")
    return folder


def environment(folder: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PYTHONPATH")}
    return {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}", **extra}


def shell(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


def raysim(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raysim.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring or other bare string."""
    strings = {
        line
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for line in range(node.lineno, node.end_lineno + 1)
    }
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in layout:
            lines |= set(range(token.start[0], token.end[0] + 1)) - strings
    return len(lines)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    return write_page(tmp_path_factory.mktemp("extending"))


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> str:
    """The page's digits.csv (its make_csv.py run once), for the tests that run its three plugins together."""
    files = write_page(tmp_path_factory.mktemp("digits"))
    done = shell(".venv/bin/python make_csv.py", files, environment(files))
    assert done.returncode == 0, done.stderr[-3000:]
    return (files / "digits.csv").read_text()


def test_the_page_shows_every_plugin_and_counts_fedavgm_right():
    files = page_files()
    assert {
        *PLUGIN_FILES,
        "test_fedavgm.py",
        "fedavgm.yaml",
        "make_csv.py",
        "fedhuber.py",
        "timed.py",
        "fedhuber.yaml",
    } <= set(files)
    fedavgm = files["fedavgm.py"]
    stated = re.search(r"`fedavgm.py` above is (\d+) lines, (\d+) of them code", PAGE.read_text())
    assert stated and (int(stated[1]), int(stated[2])) == (len(fedavgm.splitlines()), code_lines(fedavgm))
    assert len(page_commands()) == 5
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python/name:", ""))["nav"]
    assert {"Extending raysim": "extending.md"} in nav and "docs/extending.md" in (ROOT / "README.md").read_text()


def test_the_math_test_on_the_page_passes(page):
    done = shell(page_commands()[0], page, environment(page))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout


ON_RAY = {2: "term-and-executor", 4: "dataset"}
"""The blocks whose runs start Ray's workers, which import the plugins the command names: the algorithm's and the
model's runs (blocks 1 and 3) name a subset of the dataset's (the same fedavgm.yaml with FedAvgM, tiny_cnn and the
CSV source), so they run their hosts in the driver (HOSTS_IN_PROCESS): the same command and plugins, without two
more Rays and four more processes importing torch. The runs on Ray have one host actor (ONE_HOST)."""

ONE_HOST = ("--set", "runtime.num_hosts=1")
"""For a run on Ray whose subject is that Ray's workers import its plugins: one host actor shows it (the page's
configs ask for two), one worker process less importing torch and the plugins."""


def with_options(block: str, options: tuple[str, ...]) -> str:
    """`block` with `options` added to its one `raysim run` command (at the end of its last continued line)."""
    lines = block.split("\n")
    (run,) = (i for i, line in enumerate(lines) if line.startswith(".venv/bin/raysim run "))
    while lines[run].endswith("\\"):
        run += 1
    lines[run] += " " + " ".join(options)
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("block", range(1, 5), ids=["algorithm", "term-and-executor", "model", "dataset"])
def test_the_pages_commands_run_each_plugin_through_raysim_run(page, block):
    """Each example's commands as the page shows them: listed by raysim, then a real run with `--plugin` (on a local
    Ray with one host, or with its hosts in the driver where another block's run covers its plugins on Ray: ON_RAY)."""
    script = page_commands()[block]
    done = shell(with_options(script, ONE_HOST if block in ON_RAY else HOSTS_IN_PROCESS), page, environment(page))
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert RUN_LINE.search(done.stdout), done.stdout


def _all_three(tmp_path: Path, config: Path) -> dict:
    """A config naming the three plugins' entries (FedAvgM, tiny_cnn, the CSV source), written to `config`; on Ray,
    one host actor (a worker importing the plugins: what the tests check of Ray's workers)."""
    tree = tiny_config(
        algorithm={"name": "my_fedavgm", "lr": 0.05, "batch_size": 32, "server_momentum": 0.5},
        model={"name": "tiny_cnn"},
        dataset={"name": "csv", "path": str(tmp_path / "digits.csv"), "shape": [1, 8, 8]},
        rounds=2,
        runtime={"num_hosts": 1},
        tracking={"uri": fresh_store(tmp_path / "mlflow.db"), "experiment": "plugins"},
    )
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(tree))
    return tree


def _finished_run(tmp_path: Path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("plugins").experiment_id])
    assert run.info.status == "FINISHED"
    assert (run.data.tags["algorithm"], run.data.params["model.name"], run.data.tags["dataset"]) == (
        "my_fedavgm",
        "tiny_cnn",
        "csv",
    )
    assert 0.0 <= run.data.metrics["pm/acc"] <= 1.0
    return run


@pytest.mark.slow
def test_plugins_listed_in_a_config_run_from_another_folder(tmp_path, digits):
    """`plugins:` paths are relative to the config file, not to where raysim runs. The driver resolves and imports
    them before anything runs, so the hosts run in its process (HOSTS_IN_PROCESS): that Ray's workers import a
    run's plugins, whichever way they came, is the page's commands' and the installed package's test."""
    write_page(tmp_path / "plugins")
    (tmp_path / "digits.csv").write_text(digits)
    config = tmp_path / "configs" / "experiment.yaml"
    tree = _all_three(tmp_path, config)
    config.write_text(yaml.safe_dump({"plugins": [f"../plugins/{name}" for name in PLUGIN_FILES], **tree}))
    elsewhere = tmp_path / "elsewhere" / "deeper"  # `../plugins` from here is no folder: resolved against the cwd
    elsewhere.mkdir(parents=True)  # the plugins would not be found (from tmp_path / "elsewhere" they would)
    done = raysim("run", str(config), "--quiet", *HOSTS_IN_PROCESS, cwd=elsewhere, env=environment(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    run = _finished_run(tmp_path)
    assert [Path(p).name for p in yaml.safe_load(run.data.params["plugins"])] == list(PLUGIN_FILES)


@pytest.mark.slow
def test_an_installed_package_with_an_entry_point_runs(tmp_path, digits):
    """A real package (built and installed with pip into a folder) whose entry points name the three modules: with
    the folder on PYTHONPATH, raysim finds them without being told, in the driver and in Ray's workers."""
    project = tmp_path / "project"
    project.mkdir()
    for name in PLUGIN_FILES:
        (project / name).write_text(page_files()[name])
    modules = [Path(name).stem for name in PLUGIN_FILES]
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "raysim-example-plugins"\nversion = "0.1"\n\n'
        f"[tool.setuptools]\npy-modules = {modules!r}\n\n"
        '[project.entry-points."raysim.plugins"]\n' + "".join(f'{m} = "{m}"\n' for m in modules)
    )
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    installed = subprocess.run([*pip, "--target", str(site), str(project)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert list(site.glob("raysim_example_plugins-0.1.dist-info/entry_points.txt"))
    env = environment(tmp_path, PYTHONPATH=str(site))
    listed = raysim("algorithms", cwd=tmp_path, env=env)
    assert listed.returncode == 0 and "my_fedavgm" in listed.stdout, listed.stderr
    (tmp_path / "digits.csv").write_text(digits)
    config = tmp_path / "experiment.yaml"
    _all_three(tmp_path, config)
    done = raysim("run", str(config), "--quiet", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _finished_run(tmp_path).data.params["plugins"] == "[]"  # nothing listed: the entry points found them


@pytest.mark.slow
def test_a_sweeps_trials_import_the_plugins_and_its_resume_command_names_them(tmp_path):
    """A sweep of a plugin algorithm (`--plugin`, a file outside the folder raysim runs in, which Ray puts on its
    workers' path): its trials, Ray tasks, import the plugin before they unpickle their config; one diverging
    trial fails, and the command the sweep prints to rerun it names the `--plugin`, so that it works as printed
    (without it the sweep file could not be read). The trials' hosts run in their tasks (runtime.actors:
    in_process): the tasks are the subject here; host actors importing a plugin are the page's commands' test."""
    write_page(tmp_path / "page")
    base = tiny_config(
        algorithm={"name": "my_fedavgm", "lr": 0.05, "batch_size": 32},
        rounds=1,
        clients={"count": 3},
        runtime={"actors": "in_process"},
        tracking={"experiment": "plugin-sweep"},
    )
    (tmp_path / "sweep.yaml").write_text(
        yaml.safe_dump({"name": "momentum", "base": base, "grid": {"algorithm.lr": [0.05, 1e30]}})
    )
    env = environment(tmp_path)
    fresh_store(tmp_path / "mlflow.db")
    done = shell("page/.venv/bin/raysim run sweep.yaml --plugin page/fedavgm.py --quiet", tmp_path, env)
    assert done.returncode == 1, done.stderr[-3000:]
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("plugin-sweep").experiment_id
    (parent,) = client.search_runs([experiment], "tags.sweep = 'momentum'")
    nested = f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    trials = {r.data.params["algorithm.lr"]: r for r in client.search_runs([experiment], nested)}
    assert {lr: r.info.status for lr, r in trials.items()} == {"0.05": "FINISHED", "1e+30": "FAILED"}, done.stderr
    assert trials["0.05"].data.tags["algorithm"] == "my_fedavgm"
    command = f"raysim run sweep.yaml --plugin page/fedavgm.py --resume {parent.info.run_id}"
    assert done.stderr.splitlines()[-1] == f"rerun the failed ones (finished ones are kept) with `{command}`"

    rerun = shell(f"page/.venv/bin/{command} --quiet", tmp_path, env)
    assert rerun.returncode == 1 and "rerun the failed ones" in rerun.stderr, rerun.stderr[-3000:]
    after = {r.data.params["algorithm.lr"]: r for r in client.search_runs([experiment], nested)}
    assert after["0.05"].info.run_id == trials["0.05"].info.run_id  # kept, not run again
    assert after["1e+30"].info.status == "FAILED"


def test_a_plugin_that_fails_to_import_is_one_line_before_ray_starts(tmp_path):
    """Four commands in one process (one import of raysim; a plugin that failed to import is imported afresh)."""
    broken = tmp_path / "broken.py"
    broken.write_text("import numpy as np\n\nVALUE = np.zeros(3) + undefined_name\n")
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})))
    listing = tmp_path / "listing.yaml"  # `plugins:` relative to the file, read from a folder without broken.py
    listing.write_text(yaml.safe_dump({"plugins": ["broken.py"], **tiny_config()}))
    temp, elsewhere = tmp_path / "tmp", tmp_path / "elsewhere"
    temp.mkdir()
    elsewhere.mkdir()
    results = raysim_commands(
        {
            "absolute": (["run", str(config), "--plugin", str(broken)], tmp_path),
            "module": (["config", str(config), "--plugin", "no_such_mod"], tmp_path),
            "relative": (["run", str(config), "--plugin", "broken.py"], tmp_path),
            "listed": (["config", str(listing)], elsewhere),
        },
        env={"TMPDIR": str(temp), "RAY_TMPDIR": str(temp)},
    )
    for done in results.values():
        assert done["code"] == 2 and done["stdout"] == "" and not done["ray"], done["stderr"]
        assert done["stderr"].count("\n") == 1, done["stderr"]
    assert (
        results["module"]["stderr"] == "error: plugin no_such_mod: ModuleNotFoundError: No module named 'no_such_mod'\n"
    )
    for name in ("absolute", "relative", "listed"):
        assert results[name]["stderr"] == f"error: plugin {broken}: NameError: name 'undefined_name' is not defined\n"
    assert not (tmp_path / "mlflow.db").exists() and not list(temp.iterdir())  # no MLflow store, no Ray session


def test_a_plugins_text_fields_take_set_values_as_typed(tmp_path):
    """--set takes a text field of a plugin's settings as typed (YAML would drop ` #2` and make `yes` a bool),
    once `dataset.name` has chosen the plugin's source."""
    files = write_page(tmp_path)
    config = files / "experiment.yaml"
    config.write_text(yaml.safe_dump({"plugins": ["csv_source.py"], **tiny_config()}))
    done = raysim(
        "config",
        str(config),
        "--set",
        "dataset.name=csv",
        "--set",
        "dataset.path=my digits #2.csv",
        "--set",
        "dataset.label=yes",
        cwd=files,
        env=environment(files),
    )
    assert done.returncode == 0, done.stderr
    dataset = yaml.safe_load(done.stdout)["dataset"]
    assert (dataset["name"], dataset["path"], dataset["label"]) == ("csv", "my digits #2.csv", "yes")


def test_a_misspelled_plugin_name_gets_a_did_you_mean(tmp_path):
    files = write_page(tmp_path)
    config = files / "experiment.yaml"
    config.write_text(yaml.safe_dump({"plugins": list(PLUGIN_FILES), **tiny_config()}))
    cases = (
        ("algorithm.name", "my_fedavgmm", "my_fedavgm"),
        ("model.name", "tiny_cn", "tiny_cnn"),
        ("dataset.name", "cvs", "csv"),
    )
    commands = {key: (["config", str(config), "--set", f"{key}={wrong}"], files) for key, wrong, _ in cases}
    results = raysim_commands(commands)  # one process for the three: one import of raysim
    for key, _, right in cases:
        stderr = results[key]["stderr"]
        assert results[key]["code"] == 2 and stderr.count("\n") == 1, stderr
        assert stderr.startswith(f"error: {key}: unknown ") and f"did you mean '{right}'?" in stderr
        assert f", {right}" in stderr.split("(allowed: ", 1)[1]


def test_a_plugin_imported_after_the_config_module_joins_the_registries(tmp_path):
    """The bug this door replaced: a module registering itself after raysim.config was imported was refused with
    an error that listed it. Now names are looked up when a config is validated."""
    write_page(tmp_path)
    script = (
        "import raysim.config, raysim.reference\n"
        "from raysim.plugins import load\n"
        f"load({str(tmp_path / 'fedavgm.py')!r})\n"
        "from tests.support.experiments import tiny_config\n"
        "algorithm = {'name': 'my_fedavgm', 'server_momentum': 0.3}\n"
        "config = raysim.config.validate_config(tiny_config(algorithm=algorithm))\n"
        "print(type(config.algorithm).__name__, config.algorithm.server_momentum)\n"
        "print(config.model_dump()['algorithm']['server_momentum'])\n"
        "print('### `algorithm.name: my_fedavgm`' in raysim.reference.config_reference())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["FedAvgMSettings 0.3", "0.3", "True"]


def test_a_suites_plugins_reach_every_child_and_a_job_ships_files_as_modules(tmp_path):
    """A suite's `plugins:` (relative to the suite file) join each child's; `raysim submit` ships plugin files as
    py_modules and the carried config names them as modules (what the job's processes import)."""
    files = write_page(tmp_path / "mine")
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "with-plugins",
                "plugins": ["mine/fedavgm.py"],
                "base": tiny_config(),
                "runs": [{"name": "momentum", "set": {"algorithm": {"name": "my_fedavgm", "server_momentum": 0.5}}}],
            }
        )
    )
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump({"plugins": ["mine/tiny_cnn.py"], **tiny_config(model={"name": "tiny_cnn"})}))
    script = (
        "import json, sys, yaml\n"
        "from raysim.studies.suite import load_suite\n"
        "from raysim.jobs import job_spec\n"
        f"((_, child),) = load_suite({str(suite)!r}).experiments()\n"
        "print(json.dumps([type(child.algorithm).__name__, child.plugins]))\n"
        f"spec = job_spec('experiment', {str(config)!r}, plugins=[{str(files / 'fedavgm.py')!r}])\n"
        "carried = yaml.safe_load(spec.runtime_env['env_vars']['RAYSIM_JOB_CONFIG'])\n"
        "print(json.dumps([spec.runtime_env['py_modules'], carried['plugins']]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=environment(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    child, shipped = (json.loads(line) for line in done.stdout.splitlines())
    assert child == ["FedAvgMSettings", [str(files / "fedavgm.py")]]
    assert shipped == [[str(files / "tiny_cnn.py"), str(files / "fedavgm.py")], ["tiny_cnn", "fedavgm"]]
