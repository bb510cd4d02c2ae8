"""The coordinator actor: holds the server state (the global model) and runs the server step."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.algorithms import build_algorithm
from raysim.algorithms.families.consensus import start_running_mean
from raysim.algorithms.interface import Upload
from raysim.algorithms.requests import Vector
from raysim.algorithms.settings import AlgorithmSettings
from raysim.config import ExperimentConfig
from raysim.models.spec import ParamSpec
from raysim.runtime import checkpoint
from raysim.runtime.crews import Renewable
from raysim.runtime.exact_sum import PartialSum
from raysim.seeding import Kernels, use_kernels
from raysim.threats.attacks import AttackSettings
from raysim.threats.robust import RobustSettings, aggregate

if TYPE_CHECKING:
    from raysim.runtime.problem import Problem


@dataclass(frozen=True)
class CoordinatorSettings:
    """Everything the coordinator needs besides the initial model and the server data (`from_config`: as a run sets
    it up), as HostSettings is the hosts'."""

    algorithm: AlgorithmSettings
    params: ParamSpec
    """The layout of the model's flat vector."""
    num_clients: int
    """m, the training clients."""
    torch_threads: int = 1
    robust: RobustSettings | None = None
    """Replaces the mean of the messages by a robust aggregate (raysim.threats.robust); the hosts must then send
    messages."""
    attack: AttackSettings | None = None
    """Sets Multi-Krum's default f = floor(attack.fraction * n) for the n messages of each aggregation
    (AttackSettings.num_malicious; `aggregation.byzantine` overrides it)."""
    deterministic: Kernels = "cudnn"
    """torch's kernel choice (runtime.deterministic), set once torch is loaded here (`Coordinator._use_kernels`)."""

    @classmethod
    def from_config(cls, config: ExperimentConfig, problem: Problem) -> CoordinatorSettings:
        """The coordinator's settings of a run of `config` on the prepared `problem`."""
        runtime = config.runtime
        assert problem.num_training is not None  # Problem.__post_init__ sets it
        assert problem.params is not None  # a prepared problem has its model's layout
        return cls(
            config.algorithm,
            problem.params,
            problem.num_training,
            runtime.torch_threads,
            config.aggregation,
            config.attack,
            runtime.deterministic,
        )


class Coordinator(Renewable):
    """Holds the server state and runs the server step. It imports torch only if its algorithm's server step needs
    it (FedSLR's SVD, AugFL's knowledge transfer): most coordinators only add vectors, and a process that imports
    torch starts a second later and holds 200 MB more."""

    def __init__(self, settings: CoordinatorSettings, init_params: Vector, server_data: Any = None):
        """`server_data` (what `Algorithm.server_data` returned in the driver) is handed to the algorithm's
        `setup_server` here and nowhere else."""
        _use_threads(settings.torch_threads)
        self.kernels: Kernels | None = settings.deterministic
        """The kernel choice still to set, when torch is loaded (None: set)."""
        self.algorithm = build_algorithm(settings.algorithm, settings.params)
        if server_data is not None:
            self.algorithm.setup_server(server_data)
        self._use_kernels()
        self.state = self.algorithm.init_server(init_params, settings.num_clients)
        robust = settings.robust
        self.robust = robust if robust is not None and robust.active else None
        self.attack = settings.attack
        self.num_clients = settings.num_clients
        self.init_params = np.asarray(init_params, dtype=np.float32)
        self.latest: np.ndarray | None = None
        """Delta uploads: every client's latest message (m x d), allocated on first use."""
        self.served_sum: np.ndarray | None = None
        """Delta uploads: the running sum of messages the server step holds, as the coordinator made it."""
        self.seen: set[int] = set()

    def broadcast(self) -> object:
        return self.algorithm.broadcast(self.state)

    def broadcast_bytes(self) -> int:
        """Bytes of this round's broadcast to one client (Algorithm.downlink_bytes)."""
        return self.algorithm.downlink_bytes(self.algorithm.broadcast(self.state))

    def aggregate(self, *partials: PartialSum | None) -> dict[str, float]:
        """Merge the hosts' exact partial sums and run the server step; returns its metrics."""
        present = [p for p in partials if p is not None]
        if not present:  # every selected upload was dropped (runtime.on_nonfinite = drop_client)
            return {}
        total = present[0]
        for partial in present[1:]:
            total = total + partial
        upload = total.decode()
        by_client = self.algorithm.reads_messages(self.algorithm.settings)
        if (self.robust is not None or by_client) and len(total.messages) != total.count:
            raise RuntimeError("the server step needs every client's message; start hosts with send_messages")
        if self.robust is not None:
            upload = self._robust_upload(upload, total.messages, self.robust)
        if by_client:
            messages = {client: message for client, (message, _previous) in total.messages.items()}
            self.state, metrics = self.algorithm.server_step_by_client(self.state, upload, total.count, messages)
        else:
            self.state, metrics = self.algorithm.server_step(self.state, upload, total.count)
        self._use_kernels()
        return metrics

    def _use_kernels(self) -> None:
        """Set torch's kernel choice (raysim.seeding.use_kernels) once torch is loaded in this process: a coordinator
        whose algorithm trains or runs torch here (AugFL's transfer in setup_server, FedSLR's SVD in its first server
        step) gets it, the others never load torch for it."""
        if self.kernels is not None and "torch" in sys.modules:
            use_kernels(self.kernels)
            self.kernels = None

    def _robust_upload(
        self, upload: Upload, messages: dict[int, tuple[np.ndarray, np.ndarray | None]], rule: RobustSettings
    ) -> Upload:
        """The summed upload changed so that the server's mean of messages becomes their robust aggregate.

        Averaging uploads: over this round's messages. Delta uploads: over the latest messages of all m
        clients (see raysim.threats.robust), and the sum sent is what moves the server's running sum to m * aggregate.
        """
        reference = np.asarray(self.algorithm.message_coordinates(self.algorithm.global_model(self.state)), np.float64)

        def byzantine(rows: int) -> int:  # Multi-Krum's default f: floor(attack.fraction * n) of these n rows
            return self.attack.num_malicious(rows) if self.attack is not None else 0

        if not upload.delta:
            rows = np.stack([messages[c][0] for c in sorted(messages)])
            # the total carries sum(weight) * mean; without a weight field the weight is the count
            scale = 1.0 if upload.weight_field else float(len(rows))
            robust = aggregate(rule, rows, byzantine(len(rows)), reference)
            return upload.with_message(scale * robust)
        initial = np.asarray(self.algorithm.message_coordinates(self.init_params), dtype=np.float64)
        if self.latest is None:  # every client's message starts as the initial model's, as the server step's sum
            self.latest = np.tile(initial.astype(np.float32), (self.num_clients, 1))
            self.served_sum = start_running_mean(initial, self.num_clients).running_sum
        assert self.served_sum is not None  # set together with latest
        for client_id, (message, previous) in messages.items():
            if client_id not in self.seen:  # its initial message was assumed to be the initial model's
                self.served_sum += np.asarray(previous, dtype=np.float64) - initial
                self.seen.add(client_id)
            self.latest[client_id] = message
        target = self.num_clients * aggregate(rule, self.latest, byzantine(len(self.latest)), reference)
        upload = upload.with_message(target, self.served_sum)
        self.served_sum = target
        return upload

    def global_model(self) -> Vector:
        return self.algorithm.global_model(self.state)

    def evaluation_context(self) -> object:
        """What evaluation needs of the server state besides the global model (Algorithm.evaluation_context)."""
        return self.algorithm.evaluation_context(self.state)

    def server_state(self) -> object:
        return self.state

    def pid(self) -> int:
        """The actor's process id (fault-injection tests kill it)."""
        return os.getpid()

    def save_checkpoint(self, path: str) -> str | None:
        """Write the server state and the robust aggregator's memory to one .npz file; a failure: its one line."""
        tree = {"state": self.state, "latest": self.latest, "served_sum": self.served_sum, "seen": self.seen}
        return checkpoint.write_tree(path, tree)

    def restore_checkpoint(self, path: str) -> None:
        tree = checkpoint.load_tree(path)
        self.state, self.latest, self.served_sum, self.seen = (
            tree["state"],
            tree["latest"],
            tree["served_sum"],
            set(tree["seen"]),
        )


def _use_threads(count: int) -> None:
    """The intra-op threads of torch in this process: set now if torch is imported, else when it is (torch takes
    OMP_NUM_THREADS at import)."""
    os.environ["OMP_NUM_THREADS"] = str(count)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(count)
