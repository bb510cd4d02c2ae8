"""`clients.batches: authors`: the FLAME authors' mini-batches, replayed (raysim.training.authors_batches).

The reference is their main.py/update.py written out in plain torch, in their call order, with their own
components (global `torch.manual_seed`/`random.seed`/`np.random.seed`, `DataLoader(shuffle=True)`,
`random.choice(list(trainloader))`, a new `torch.optim.SGD(momentum)` per copy step, `nn.CrossEntropyLoss`), on a
tiny problem; raysim's runs are compared with it.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.models.flat import ModelSpec
from raysim.training.authors_batches import AuthorsBatchPlan, AuthorsStreams
from tests.support.authors import their_q_label
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

SEED, CLIENTS, BATCH = 3, 3, 48


def _authors_config(algorithm: dict, training: str = "sequential", **sections) -> dict:
    """3 clients of 2 label shards of the synthetic 4-class data (about 400 training samples each: batches of 48
    leave a short last one), their dealing, their initial model and their batches."""
    return tiny_config(
        algorithm=algorithm,
        partition={"scheme": "q_label", "q": 2, "draw": "authors"},
        model={"name": "mlr", "init": "authors"},
        clients={"count": CLIENTS, "batches": "authors"},
        seed=SEED,
        runtime={"num_hosts": 1, "client_training": training},
        **sections,
    )


class _DatasetSplit(Dataset):
    """update.py's DatasetSplit (no attack, no noise): sample `item` of a client's index list."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, idxs: list[int]):
        self.x, self.y, self.idxs = x, y, idxs

    def __len__(self) -> int:
        return len(self.idxs)

    def __getitem__(self, item: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[self.idxs[item]], self.y[self.idxs[item]]


class _TheirClient:
    """PerLocalUpdate for framework=ditto, reduced to what moves the global copy (the personal model's passes are
    made, as they draw from the same streams, but the copy never depends on it)."""

    def __init__(self, global_model: nn.Module, idxs: list[int], x: torch.Tensor, y: torch.Tensor):
        self.local_model = copy.deepcopy(global_model)
        train_size = int(0.8 * len(idxs))
        random.shuffle(idxs)
        self.train, self.test = idxs[:train_size], idxs[train_size + 1 :]
        self.trainloader = DataLoader(_DatasetSplit(x, y, self.train), batch_size=BATCH, shuffle=True)
        self.testloader = DataLoader(_DatasetSplit(x, y, self.test), batch_size=BATCH, shuffle=True)
        self.picked: list[int] = []
        for _ in self.trainloader:  # inference(): the training losses
            pass
        for _ in self.testloader:  # test_inference()
            pass

    def update_weights(self, eta: float, momentum: float) -> None:
        for _ in self.trainloader:  # the personal model's epoch
            pass
        optimizer_local = torch.optim.SGD(self.local_model.parameters(), lr=eta, momentum=momentum)
        images, labels = random.choice(list(self.trainloader))
        self.picked.append(len(images))
        self.local_model.zero_grad()
        optimizer_local.zero_grad()
        nn.CrossEntropyLoss()(self.local_model(images), labels.long()).backward()
        optimizer_local.step()
        for _ in self.testloader:  # test_inference()
            pass

    def flat_copy(self) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in self.local_model.parameters()]).numpy()


@pytest.mark.parametrize("training", ["sequential", "vectorized"])
def test_ditto_copies_and_gm_equal_their_update_py_batch_for_batch(training):
    """Three rounds of Ditto (global_resync false, global_steps one_batch, eta 0.1, momentum 0.5, mu 0.01): every
    client's never-resynced copy after each round, and the server's average of all m copies, equal theirs."""
    eta, momentum = 0.1, 0.5
    config = validate_config(
        _authors_config(
            {
                "name": "ditto",
                "lambda": 1.0,
                "lr": 0.05,
                "batch_size": BATCH,
                "momentum": momentum,
                "weight_decay": 0.01,
                "global_resync": False,
                "global_steps": "one_batch",
                "global_lr": eta,
            },
            training,
        )
    )
    sim = InProcess(config)
    x, y = torch.from_numpy(sim.problem.x), torch.from_numpy(sim.problem.y)

    torch.manual_seed(SEED)  # setup_seed
    np.random.seed(SEED)
    random.seed(SEED)
    groups = their_q_label(sim.problem.y, CLIENTS, 2)  # get_dataset
    global_model = nn.Linear(20, 4)  # their model, then main.py's projection matrix
    torch.normal(mean=0, std=1.0, size=(10, sum(p.numel() for p in global_model.parameters())))
    flat = torch.cat([p.detach().reshape(-1) for p in global_model.parameters()]).numpy()
    np.testing.assert_array_equal(flat, sim.problem.init_params)
    clients = [_TheirClient(global_model, [int(i) for i in groups[c]], x, y) for c in range(CLIENTS)]
    for c, (_, split) in enumerate(sim.problem.clients):
        assert split.train.tolist() == clients[c].train

    for round_index in range(3):
        for client in clients:
            client.update_weights(eta, momentum)
        sim.round(round_index)
        for c, client in enumerate(clients):
            np.testing.assert_allclose(sim.states[c].w, client.flat_copy(), atol=1e-6)
        theirs = np.mean([client.flat_copy() for client in clients], axis=0)
        np.testing.assert_allclose(sim.coordinator.global_model(), theirs, atol=1e-6)
    picked = [size for client in clients for size in client.picked]
    assert min(picked) < BATCH == max(picked)  # some copy stepped on a short last batch, as theirs can


def test_streams_equal_dataloader_passes_in_their_order():
    """FLAME's layout (one pass per round): every pass of every client in two rounds is the permutation their
    DataLoader draws, after their model and projection draws and the first training and test passes."""
    train_sizes, test_sizes = (37, 50, 23), (9, 12, 5)
    spec = ModelSpec("mlr", (6,), 3, "classification")
    plan = AuthorsBatchPlan(
        SEED, tuple(a + b + 1 for a, b in zip(train_sizes, test_sizes, strict=True)), train_sizes, 10, passes=1, picks=0
    )
    streams = AuthorsStreams(plan, spec.build().module)
    init = spec.build().initial_parameters(SEED)  # model.init: authors (building a model draws: before their seed)

    torch.manual_seed(SEED)
    their_model = nn.Linear(6, 3)
    flat = torch.cat([p.detach().reshape(-1) for p in their_model.parameters()]).numpy()
    np.testing.assert_array_equal(flat, init)
    torch.normal(mean=0, std=1.0, size=(10, flat.size))
    loaders = [
        (DataLoader(list(range(a)), batch_size=10, shuffle=True), DataLoader(list(range(b)), shuffle=True))
        for a, b in zip(train_sizes, test_sizes, strict=True)
    ]
    for train, test in loaders:
        list(train), list(test)
    for round_index in range(2):
        for client, (train, test) in enumerate(loaders):
            theirs = torch.cat(list(train)).numpy()
            list(test)
            draws = streams.round_draws(client, round_index)
            np.testing.assert_array_equal(draws.permutation(train_sizes[client]), theirs)
            with pytest.raises(RuntimeError, match="more than the 1 passes"):
                draws.permutation(train_sizes[client])


def test_flame_with_their_batches_runs_alike_one_client_at_a_time_and_stacked():
    """The stacked, lockstep path (vectorized FLAME) takes the replayed shuffles as the sequential one does."""
    algorithm = {
        "name": "flame",
        "lambda": 1.0,
        "rho": 0.25,
        "lr": 0.05,
        "batch_size": BATCH,
        "epochs": 2,
        "momentum": 0.5,
    }
    states = []
    for training in ("sequential", "vectorized"):
        sim = InProcess(validate_config(_authors_config(algorithm, training)))
        for round_index in range(2):
            sim.round(round_index)
        states.append(sim.states)
    for c in states[0]:
        np.testing.assert_allclose(states[0][c].theta, states[1][c].theta, atol=1e-5)
    other = InProcess(validate_config(_authors_config(algorithm) | {"clients": {"count": CLIENTS}}))
    other.round(0)
    other.round(1)
    assert not np.allclose(other.states[0].theta, states[0][0].theta, atol=1e-4)  # raysim's batches differ


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"partition": {"scheme": "q_label", "q": 2}}, "partition.draw: authors"),
        ({"model": {"name": "mlr"}}, "model.init: authors"),
        ({"clients": {"count": CLIENTS, "batches": "authors", "per_round": 2}}, "every client training every round"),
        ({"attack": {"kind": "label_poisoning", "fraction": 0.4}}, "attack.kind: none"),
        ({"partition": {"scheme": "quality", "draw": "authors", "layout": "contiguous"}}, "no quality-skew"),
        ({"algorithm": {"name": "ditto"}}, "not 'ditto' with these settings"),
        (
            {"algorithm": {"name": "ditto", "global_resync": False, "global_steps": "one_batch", "epochs": 2}},
            "not 'ditto' with these settings",
        ),
        ({"algorithm": {"name": "fedavg"}}, "not 'fedavg' with these settings"),
    ],
)
def test_settings_their_batches_cannot_be_replayed_for_are_refused_in_one_line(change, named):
    tree = _authors_config({"name": "flame"}) | change
    with pytest.raises(ConfigError) as error:
        validate_config(tree)
    message = str(error.value)
    assert "clients.batches=authors needs" in message and named in message and "\n" not in message
