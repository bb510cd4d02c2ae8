"""raysim's Python API: one call runs an experiment from a notebook or a script, as `raysim run` does, and hands back
what it made as pandas tables and torch tensors (docs/python-api.md).

    result = raysim.run("configs/quickstart.yaml", "rounds=2", "clients.count=4")
    result.history        # one row per round, one column per metric logged to MLflow
    result.clients        # one row per client: malicious/held-out flags, sizes, final PM/GM/HM scores
    result.global_model   # the final global model's parameters (name -> tensor)
    result.model()        # ... as the torch.nn.Module of the config's model, ready to evaluate

The run is the same MLflow run the command line makes (`result.run_id`), logged where `raysim run` logs it. Nothing
here imports Ray, torch or pandas until a run is asked for: `import raysim` stays cheap.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    import torch

    from raysim.config import ExperimentConfig
    from raysim.data.dataset import Dataset
    from raysim.data.scheme import ClientSplit
    from raysim.models.composed import ComposedNetwork
    from raysim.models.flat import ModelSpec
    from raysim.runtime.simulation import Simulation
    from raysim.tracking.callbacks import RunResult

_last_dataset: list[tuple[str, Dataset]] = []
"""The dataset loaded last (its seed and settings, itself), kept for the next `_dataset` call: a notebook scores
client after client (`Result.test_data`), and a run's `Result` is made right after the dataset's shapes are read."""


@dataclass(frozen=True)
class Result:
    """What one run made: its MLflow run id, its metrics as tables and its final models as tensors."""

    run_id: str
    """The MLflow run (`mlflow.get_run(run_id)`, `raysim table RUN_ID`), in `tracking_uri`."""
    tracking_uri: str
    config: ExperimentConfig
    """The validated config the run used (overrides applied)."""
    history: pd.DataFrame
    """One row per evaluated step, indexed by `round` (0: before training), one column per metric key exactly as
    logged to MLflow at that step (`pm/acc`, `gm/loss`, `traffic/uplink_bytes`, ...); NaN where a step did not log
    the key (round 0 has no training metrics)."""
    clients: pd.DataFrame
    """One row per client, indexed by `client_id`: `malicious`, `heldout`, `num_train`, `num_test`, then its final
    scores `<model>_<score>` for the PM, the GM, the HM and the algorithm's further models (the run's
    clients.parquet artifact)."""
    summary: dict[str, float]
    """Final and best-round means over the benign training clients (`final/pm/acc`, `best/gm/acc`, ...)."""
    global_model: dict[str, torch.Tensor]
    """The final global model's parameters and running statistics by name (a state dict of the config's model
    without BatchNorm's batch counters)."""
    personalized_models: dict[int, dict[str, torch.Tensor]]
    """Each training client's final personalized model (the PM its scores are of), by client id; empty for an
    algorithm whose clients deploy the global model (FedAvg, FedProx) or when `run(..., personalized=False)`."""
    model_spec: ModelSpec = field(repr=False)
    """The network's name, input shape and outputs (what `model` builds)."""
    splits: list[ClientSplit] = field(repr=False)
    personalized_network: ComposedNetwork | None = field(default=None, repr=False)
    """What the personalized models are when they are not the network (Algorithm.personalized_network: FedCP's gated
    heads, GPFL's feature valve, whose tensors are named as raysim.models.gated's modules'); None: the network."""
    """Every client's sample indices into the dataset (train, test, validation), as the run partitioned it."""

    def __repr__(self) -> str:
        """One line (a notebook shows a bare `result` so): the run, what ran, and its final accuracies."""
        final = " ".join(
            f"{k.upper()} {self.summary[f'final/{k}/acc']:.4f}"
            for k in ("pm", "gm", "hm")
            if f"final/{k}/acc" in self.summary
        )
        config = self.config
        return (
            f"Result(run {self.run_id}: {config.algorithm.name} on {config.dataset.name}, {config.rounds} rounds, "
            f"{config.clients.count} clients; final {final})"
        )

    def model(self, client_id: int | None = None) -> torch.nn.Module:
        """The config's network (`model.name`) holding the final global model, or client `client_id`'s personalized
        model, in eval mode."""
        from raysim.models.zoo import build_module

        if client_id is not None and client_id not in self.personalized_models:
            raise KeyError(
                f"client {client_id} has no personalized model in this result (clients with one: "
                f"{sorted(self.personalized_models)[:10]})"
            )
        parameters = self.global_model if client_id is None else self.personalized_models[client_id]
        spec = self.model_spec
        module = build_module(spec.name, spec.input_shape, spec.outputs)
        if client_id is not None and self.personalized_network is not None:
            from raysim.models.flat import composed_module

            module = composed_module(module, self.personalized_network)
        unexpected = module.load_state_dict(parameters, strict=False).unexpected_keys
        assert not unexpected, unexpected  # the parameters were laid out by this same network
        return module.eval()

    def test_data(self, client_id: int | None = None, split: str = "test") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of client `client_id`'s split (`test`, `train` or `val`), or of every client's, as the
        model takes them (normalized as the hosts do, never augmented). The noise a quality-skew partition or a
        label-poisoning attacker draws at every access is not added."""
        import numpy as np
        import torch

        if split not in ("test", "train", "val"):
            raise ValueError(f"split must be test, train or val (got {split!r})")
        from raysim.training.local import Inputs

        chosen = self.splits if client_id is None else [s for s in self.splits if s.client_id == client_id]
        if not chosen:
            raise KeyError(f"no client {client_id} (clients 0..{len(self.splits) - 1})")
        dataset = _dataset(self.config)
        indices = np.concatenate([getattr(s, split) for s in chosen]).astype(np.int64)
        inputs = Inputs(dataset.mean, dataset.std)  # the hosts' evaluation input: normalized, never augmented
        return torch.from_numpy(inputs.rows(dataset.x, indices)), torch.from_numpy(dataset.y[indices])


@dataclass(frozen=True)
class SuiteResult:
    """What a suite made: its parent MLflow run and its children's metrics as tables."""

    parent_run_id: str
    tracking_uri: str
    runs: pd.DataFrame
    """One row per child run (and seed): `run`, `seed`, `algorithm`, `status` (finished or failed), `run_id`,
    `error`, then its final and best summaries (`final/pm/acc`, `best/pm/acc`, ...): the suite's summary table."""
    history: pd.DataFrame
    """Every finished child's history (`Result.history`), indexed by (`run`, `seed`, `round`)."""

    @property
    def failed(self) -> pd.DataFrame:
        """The rows of `runs` whose child failed, with its one-line error."""
        return self.runs[self.runs["status"] != "finished"]


def run(
    config: str | Path | Mapping[str, Any] | ExperimentConfig,
    *overrides: str,
    plugins: Sequence[str] = (),
    progress: bool = True,
    tracking_uri: str | None = None,
    personalized: bool = True,
) -> Result:
    """Run one experiment to the end, logged to MLflow as `raysim run` logs it, and return its `Result`.

    `config`: a YAML file's path, a config tree (a dict as YAML gives it) or an ExperimentConfig. `overrides`:
    `key=value` strings as `--set` takes them (`"rounds=2"`, `"algorithm.rho=0.1"`). `plugins`: modules or `.py`
    files imported before the config is validated, as `--plugin` (files relative to the current directory).
    `progress`: the progress bar on stderr. `tracking_uri`: the MLflow store (as `--tracking-uri`; default the
    config's `tracking.uri`, else $MLFLOW_TRACKING_URI, else ./mlflow.db). `personalized`: fetch every client's
    final personalized model too (all of them pass through this process: for many clients, set False).

    Bad input raises the ConfigError (or another RaysimError) whose one line `raysim run` prints; Ray is started
    for the run (and stopped after it) unless this process has joined one already (`ray.init`).
    """
    from raysim.errors import RaysimError
    from raysim.runtime.driver import run_experiment

    chosen = experiment_config(config, overrides, plugins, tracking_uri)
    final = _FinalModels(chosen.rounds, personalized)
    try:
        outcome = run_experiment(chosen, show_progress=progress, inspect=final)
    except (RaysimError, KeyboardInterrupt):
        raise  # already one line (a bad input, a diverged run, Ctrl-C)
    except Exception as error:  # noqa: BLE001 - a failure while the run ran: one line, the rest in a file
        raise RunFailed.of(error) from None
    return _result(chosen, outcome, final)


class RunFailed(RuntimeError):
    """A run that failed while it ran (not for its input): one short line (the run id, what failed and where, the
    file that holds the full report, Ray's included) instead of Ray's report of the remote traceback, 60 lines a
    failure; the original exception is `cause`."""

    def __init__(self, message: str, run_id: str | None, log: Path, cause: BaseException):
        super().__init__(message)
        self.run_id, self.log, self.cause = run_id, log, cause

    @classmethod
    def of(cls, error: BaseException) -> RunFailed:
        """The RunFailed of `error` as `run_experiment` raised it (the run's id attached by the driver), its full
        report written to a file in the temporary folder."""
        import re
        import tempfile
        import traceback

        from raysim.credentials import redact_text

        run_id: str | None = getattr(error, "raysim_run_id", None)
        report = re.sub(r"\x1b\[[0-9;]*m", "", "".join(traceback.format_exception(error)))  # Ray colours its header
        folder = Path(tempfile.gettempdir()) / "raysim-errors"
        folder.mkdir(exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f"run-{run_id or 'unstarted'}-", suffix=".log", dir=folder)
        with open(handle, "w") as log:
            log.write(redact_text(report))
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        what = lines[-1] if lines else type(error).__name__
        if not what.startswith(type(error).__name__) and not type(error).__module__.startswith("ray."):
            what = f"{type(error).__name__}: {what}"
        # the innermost frame of the report: a Ray actor's own (its traceback is in the error's text), else this one's
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', report)
        where = f"{Path(frames[-1][0]).name}:{frames[-1][1]} in {frames[-1][2]}" if frames else "the driver"
        actors = re.findall(r"ray::([\w.]+)\(", report)
        if actors:  # the actor call it failed in: ray::Coordinator.aggregate()
            where += f", called as {actors[-1]}"
        run = f"run {run_id}" if run_id else "the run (before its MLflow run was made)"
        message = f"{run} failed: {redact_text(what)[:300]} (in {where}); full report: {name}"
        return cls(message, run_id, Path(name), error)


def experiment_config(
    config: str | Path | Mapping[str, Any] | ExperimentConfig,
    overrides: Sequence[str] = (),
    plugins: Sequence[str] = (),
    tracking_uri: str | None = None,
) -> ExperimentConfig:
    """The validated config `run` runs: `config`'s plugins and `plugins` imported, then `overrides` applied, as
    `raysim run CONFIG --plugin ... --set ...` does (a path's own `plugins:` are relative to its folder)."""
    import raysim.plugins as plugin_files
    from raysim.config import ExperimentConfig, apply_overrides, load_config, validate_config, with_plugins
    from raysim.errors import ConfigError

    assignments = [*overrides, *([f"tracking.uri={tracking_uri}"] if tracking_uri is not None else [])]
    if isinstance(config, str | Path):
        return load_config(config, assignments, tuple(plugins))
    if isinstance(config, ExperimentConfig):
        tree = config.model_dump(mode="json", by_alias=True)
    elif isinstance(config, Mapping):
        tree = copy.deepcopy(dict(config))
    else:
        raise ConfigError(f"config: a YAML file's path, a dict or an ExperimentConfig (got {type(config).__name__})")
    tree = with_plugins(tree, None, plugin_files.resolve(list(plugins), None, "plugins"))
    apply_overrides(tree, assignments)
    return validate_config(tree)


def run_suite(
    path: str | Path,
    *overrides: str,
    plugins: Sequence[str] = (),
    progress: bool = True,
    tracking_uri: str | None = None,
) -> SuiteResult:
    """Run a suite file (a base experiment and its `runs:`, docs/reproducing.md) as `raysim run SUITE.yaml` does:
    every child an MLflow run nested under one parent run. `overrides` apply to the base experiment; the other
    arguments are `run`'s. A child that fails does not stop the others: see `SuiteResult.failed`."""
    import pandas as pd

    from raysim.config import read_mapping
    from raysim.errors import ConfigError
    from raysim.launch import study_command
    from raysim.studies import suite as suites

    if "runs" not in read_mapping(path, "suite"):
        raise ConfigError(f"{path}: not a suite (no top-level `runs:`); run one experiment with raysim.run")
    assignments = [*overrides, *([f"tracking.uri={tracking_uri}"] if tracking_uri is not None else [])]
    suite = suites.load_suite(path, assignments, tuple(plugins))
    done = suites.run_suite(suite, show_progress=progress, command=study_command(path, assignments, tuple(plugins)))
    histories = {
        (child.name, child.config.seed): _history(child.outcome.history)
        for child in done.children
        if child.outcome.finished
    }
    history = pd.concat(histories, names=["run", "seed"]).sort_index() if histories else pd.DataFrame()
    return SuiteResult(done.parent_run_id, done.tracking_uri, pd.DataFrame(done.table), history)


class _FinalModels:
    """The driver's per-round hook (run_experiment's `inspect`) that, after the last round, fetches the global model
    from the coordinator and the clients' states from the hosts, through the calls checkpoints and tests use."""

    def __init__(self, rounds: int, personalized: bool):
        self.rounds, self.personalized = rounds, personalized
        self.global_params: np.ndarray | None = None
        self.context: object = None
        """The coordinator's Algorithm.evaluation_context after the last round."""
        self.states: dict[int, object] = {}

    def __call__(self, round_index: int, simulation: Simulation) -> None:
        if round_index + 1 < self.rounds:
            return
        import numpy as np

        self.global_params = np.asarray(simulation.global_model(), np.float32)
        self.context = simulation.evaluation_context()
        self.states = simulation.client_states() if self.personalized else {}


def _result(config: ExperimentConfig, outcome: RunResult, final: _FinalModels) -> Result:
    """The Result of a finished run: its tables, and its final models laid out by the config's network (the dataset
    is read again for its shapes and partition, which are made from the config's seed as the run made them)."""
    import pandas as pd

    from raysim.algorithms import build_algorithm
    from raysim.data import partition_dataset
    from raysim.models.flat import ModelSpec
    from raysim.tracking.mlflow_writer import resolve_tracking_uri

    assert outcome.run_id is not None  # run_experiment returns only once the run is opened and finished
    if final.global_params is None:
        raise RuntimeError(f"run {outcome.run_id}: the final models were not fetched after its last round")
    dataset = _dataset(config)
    splits = partition_dataset(
        dataset.y, config.clients.count, config.partition, config.seed, dataset.groups, dataset.test_start
    )
    spec = ModelSpec(config.model.name, dataset.input_shape, dataset.output_dim, dataset.task)
    params = spec.build().spec
    algorithm = build_algorithm(config.algorithm, params)
    training = config.clients.training_count
    network = algorithm.personalized_network()
    personal = {
        c: algorithm.evaluated_model(s, final.global_params)
        if network is None
        else algorithm.composed_model(s, final.global_params, final.context)
        for c, s in sorted(final.states.items())
        if c < training
    }
    personal_params = params if network is None else spec.build().composed(network).spec
    sizes = {
        s.client_id: {
            "malicious": s.client_id in outcome.malicious,
            "heldout": s.client_id >= training,
            "num_train": len(s.train),
            "num_test": len(s.test),
        }
        for s in splits
    }
    rows = [{"client_id": e.client_id, **sizes[e.client_id], **e.row()} for e in outcome.final]
    clients = pd.DataFrame(rows).set_index("client_id").sort_index() if rows else pd.DataFrame()
    return Result(
        run_id=outcome.run_id,
        tracking_uri=resolve_tracking_uri(config.tracking.uri),
        config=config,
        history=_history(outcome.history),
        clients=clients,
        summary=dict(outcome.summary),
        global_model=_tensors(params, final.global_params),
        personalized_models={c: _tensors(personal_params, p) for c, p in personal.items() if p is not None},
        model_spec=spec,
        splits=splits,
        personalized_network=network,
    )


def _history(history: dict[int, dict[str, float]]) -> pd.DataFrame:
    import pandas as pd

    table = pd.DataFrame.from_dict(history, orient="index").sort_index()
    table.index.name = "round"
    return table


def _tensors(params: Any, flat: Any) -> dict[str, torch.Tensor]:
    """A flat parameter vector as named tensors (copies, shaped as the network's parameters)."""
    import numpy as np
    import torch

    vector = torch.from_numpy(np.array(flat, dtype=np.float32))
    return {name: tensor.clone() for name, tensor in params.unflatten(vector).items()}


def _dataset(config: ExperimentConfig) -> Dataset:
    """The config's dataset, loaded once for consecutive calls about the same dataset and seed (`_last_dataset`)."""
    key = f"{config.seed}:{config.dataset.model_dump_json()}"
    if not _last_dataset or _last_dataset[0][0] != key:
        _last_dataset[:] = [(key, config.dataset.loaded(config.seed))]
    return _last_dataset[0][1]
