"""What a client host is set up with besides its data and clients: the run's settings that reach the hosts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raysim.algorithms import ALGORITHMS
from raysim.algorithms.settings import AlgorithmSettings, SGDSettings
from raysim.config import ExperimentConfig
from raysim.evaluation.classification import SingleLabelAuc
from raysim.evaluation.clients import TrainLossUnit
from raysim.models.flat import ModelSpec
from raysim.seeding import Kernels
from raysim.threats.attacks import AttackPlan
from raysim.training.authors_batches import AuthorsBatchPlan
from raysim.training.local import Inputs

if TYPE_CHECKING:
    from raysim.runtime.problem import Problem


@dataclass(frozen=True)
class HostSettings:
    """Everything a host needs besides its data and clients (`from_config`: as a run sets its hosts up)."""

    algorithm: AlgorithmSettings
    model: ModelSpec
    seed: int
    torch_threads: int = 1
    attack: AttackPlan | None = None
    """Which clients are malicious and how (None: no attack)."""
    send_messages: bool = False
    """Add each selected client's message to the partial sums, for a robust aggregator at the coordinator or a
    server step that reads them (Algorithm.reads_messages)."""
    auc_single_label: SingleLabelAuc = "zero"
    """The AUC of a one-label test split (raysim.evaluation.classification.classification_scores)."""
    on_nonfinite: str = "stop"
    """`stop` raises UploadRangeError on a NaN/inf upload, `drop_client` leaves it out (runtime.on_nonfinite)."""
    state_memory_mb: float | None = None
    """Client states beyond this spill to a folder in `spill_dir` (runtime.state_memory_mb, runtime.spill_dir)."""
    spill_dir: str | None = None
    client_training: str = "auto"
    """`vectorized`: the selected clients train together, `vectorize_chunk` at a time; `auto`: so for perceptrons
    and on GPUs (runtime.client_training)."""
    vectorize_chunk: int = 16
    gpus: float = 0.0
    """The host's GPU share: vectorized training runs on the GPU when it has one (runtime.host_gpus)."""
    inputs: Inputs = Inputs()
    """How the dataset's stored rows become model input: the dataset's normalization, dataset.augment."""
    loss_sum_batch: int = 100
    """Batch size of the summed test loss (tracking.loss_sum_batch)."""
    train_loss_every: int = 1
    """Score training losses at every N-th evaluation, 0: never (tracking.train_loss)."""
    train_sizes: tuple[int, ...] | None = None
    """The distinct training-split sizes of the run's clients: vectorized batches are padded to no more samples
    than one of them needs at that step (VectorizedTrainer.train_sizes; the same for every host, so results do not
    depend on the hosts)."""
    batches: AuthorsBatchPlan | None = None
    """clients.batches = authors: the run's clients' mini-batches are the FLAME authors' code's (every host replays
    their streams for all clients, raysim.training.authors_batches); None: from the clients' seeded streams."""
    train_loss_unit: TrainLossUnit = "mean"
    """Unit of the scored training loss (tracking.train_loss_unit)."""
    deterministic: Kernels = "cudnn"
    """torch's kernel choice in the host's process (runtime.deterministic, raysim.seeding.use_kernels)."""
    state_folder: str | None = None
    """runtime.state_store = memory or disk: the folder of the run's shared client-state columns
    (raysim.runtime.state_columns; the driver makes it); None: each host keeps its own clients' state."""
    eval_sample: int | None = None
    """Clients an evaluation scores, a seeded sample (tracking.eval_sample, raysim.evaluation.sampling); None: all."""

    @classmethod
    def from_config(cls, config: ExperimentConfig, problem: Problem) -> HostSettings:
        """The hosts' settings of a run of `config` on the prepared `problem` (model, attackers, inputs, clients)."""
        runtime = config.runtime
        reads_messages = ALGORITHMS.get(config.algorithm.name).reads_messages(config.algorithm)
        return cls(
            config.algorithm,
            problem.model_spec,
            config.seed,
            runtime.torch_threads,
            problem.attack,
            config.aggregation.active or reads_messages,
            config.tracking.auc_single_label,
            runtime.on_nonfinite,
            runtime.state_memory_mb,
            runtime.spill_dir,
            runtime.client_training,
            runtime.vectorize_chunk,
            runtime.host_gpus,
            problem.inputs,
            config.tracking.loss_sum_batch,
            config.tracking.train_loss_every,
            tuple(sorted({info.num_train for info, _ in problem.clients})),
            authors_batches(config, problem),
            train_loss_unit=config.tracking.train_loss_unit,
            deterministic=runtime.deterministic,
            eval_sample=config.tracking.eval_sample,
        )


def authors_batches(config: ExperimentConfig, problem: Problem) -> AuthorsBatchPlan | None:
    """What replaying the authors' mini-batches needs (clients.batches = authors), else None. Their 80/20 split
    shuffled each client's n samples and left one out: n = train + test + 1 (raysim.data.authors_draw.split)."""
    if config.clients.batches != "authors":
        return None
    settings = config.algorithm
    draws = ALGORITHMS.get(settings.name).code_draws(settings)
    # ExperimentConfig refuses clients.batches: authors for settings without the authors' draws (their algorithms all
    # train with local SGD)
    assert draws is not None and isinstance(settings, SGDSettings), "checked by ExperimentConfig._check_authors_batches"
    splits = [split for _, split in problem.clients]
    return AuthorsBatchPlan(
        config.seed,
        tuple(len(s.train) + len(s.test) + 1 for s in splits),
        tuple(len(s.train) for s in splits),
        settings.batch_size,
        draws.passes,
        draws.picks,
    )
