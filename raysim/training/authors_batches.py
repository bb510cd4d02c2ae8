"""Mini-batches drawn as the FLAME authors' code draws them (`clients.batches: authors`).

Their code (zsk66/FLAME) shuffles every pass over a client's split with a torch DataLoader: creating the pass's
iterator draws a base seed from torch's global generator, and its RandomSampler then draws the seed of the pass's
`torch.randperm`. Ditto's global copy then takes `random.choice` of the pass's batches, from Python's global
generator. Both generators start from the run's seed and are drawn from in a fixed order, so every pass of every
client can be replayed:

- torch: `torch.manual_seed(seed)`, the model's layers initialized in order (as `model.init: authors`), a 10 x d
  normal projection matrix (main.py draws it for every method), then per client in order 2 draws for its first
  pass over its training split and 2 for its test pass; then every round, per client in order, 2 per pass of its
  local work (`Algorithm.code_draws`) and 2 for its test pass (their GM and PM scores);
- Python: `random.seed(seed)`, each client's 80/20 `random.shuffle` (`partition.draw: authors`), then every round,
  per client in order, its `random.choice` picks.

Replaying needs every client to train every round (their `strategy: full`) and no draw of theirs that raysim does
not make: their quality-skew noise and label poisoning draw at every sample access, attacks draw noise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from raysim.models.zoo import reset_parameters

PROJECTION_ROWS = 10
"""Rows of the random projection main.py draws right after the model (Lp-Proj's P; drawn for every method)."""


@dataclass(frozen=True)
class AuthorsBatchPlan:
    """What replaying the authors' draws needs to know of the run (the same on every host)."""

    seed: int
    part_sizes: tuple[int, ...]
    """Each client's samples before the 80/20 split, the length of its `random.shuffle` (client ids 0..m-1)."""
    train_sizes: tuple[int, ...]
    batch_size: int
    passes: int
    """Passes over its training split a client makes per round (Algorithm.code_draws)."""
    picks: int
    """`random.choice` picks a client makes per round."""

    @property
    def num_clients(self) -> int:
        return len(self.part_sizes)


class AuthorsStreams:
    """The seeds of every client's passes and its picks, replayed as far as the rounds asked for need."""

    def __init__(self, plan: AuthorsBatchPlan, module: nn.Module):
        """`module`: a model of the run's architecture (its parameters are re-initialized here)."""
        self.plan = plan
        self._torch = _torch_after_model(plan.seed, module)
        self._seeds = np.zeros(0, np.int64)
        self._python = random.Random(plan.seed)
        for size in plan.part_sizes:  # each client's 80/20 split (raysim.data.authors_draw.split)
            self._python.shuffle(list(range(size)))
        self.batches = [-(-n // plan.batch_size) for n in plan.train_sizes]
        """How many batches a pass over each client's training split has (what its picks choose among)."""
        self._picks: list[np.ndarray] = []
        """Per round, the picks [clients, picks]."""

    def round_draws(self, client: int, round_index: int) -> RoundDraws:
        """A client's draws in one round, handed out in the order its requests make them."""
        return RoundDraws(self, client, round_index)

    def pass_seed(self, client: int, round_index: int, number: int) -> int:
        """The seed of the `number`-th pass of `client` in round `round_index` (its RandomSampler's draw)."""
        m, per_client = self.plan.num_clients, 2 * self.plan.passes + 2
        index = 4 * m + (round_index * m + client) * per_client + 2 * number + 1
        if index >= len(self._seeds):
            more = max(index + 1 - len(self._seeds), m * per_client)
            drawn = torch.empty(more, dtype=torch.int64).random_(generator=self._torch).numpy()
            self._seeds = np.concatenate([self._seeds, drawn])
        return int(self._seeds[index])

    def pick(self, client: int, round_index: int, number: int) -> int:
        """Which batch the `number`-th `random.choice` of `client` in round `round_index` takes."""
        while len(self._picks) <= round_index:
            picks = np.zeros((self.plan.num_clients, self.plan.picks), np.int64)
            for c, count in enumerate(self.batches):
                for p in range(self.plan.picks):
                    picks[c, p] = self._python.choice(range(count))
            self._picks.append(picks)
        return int(self._picks[round_index][client, number])


class RoundDraws:
    """One client's draws in one round: its passes' shuffles and its picks, in order."""

    def __init__(self, streams: AuthorsStreams, client: int, round_index: int):
        self.streams, self.client, self.round_index = streams, client, round_index
        self.passes = 0
        self.picks = 0

    def permutation(self, n: int) -> np.ndarray:
        plan = self.streams.plan
        if self.passes == plan.passes:
            raise RuntimeError(
                f"clients.batches=authors: client {self.client} makes more than the {plan.passes} passes per round "
                "the authors' code makes"
            )
        seed = self.streams.pass_seed(self.client, self.round_index, self.passes)
        self.passes += 1
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()

    def pick(self, count: int) -> int:
        plan = self.streams.plan
        expected = self.streams.batches[self.client]
        if self.picks == plan.picks or count != expected:
            raise RuntimeError(
                f"clients.batches=authors: client {self.client} picks among {count} batches (pick {self.picks + 1}); "
                f"the authors' code makes {plan.picks} picks per round among its {expected} batches"
            )
        pick = self.streams.pick(self.client, self.round_index, self.picks)
        self.picks += 1
        return pick


class ReplayedBatches:
    """A client's generator for one request with the mini-batch draws replaced by the authors' (`RoundDraws`):
    `permutation` (a pass's shuffle) and `pick` are theirs; any other draw comes from the seeded `generator`."""

    def __init__(self, draws: RoundDraws, generator: np.random.Generator):
        self.draws = draws
        self.generator = generator

    def permutation(self, n: int) -> np.ndarray:
        return self.draws.permutation(n)

    def pick(self, count: int) -> int:
        return self.draws.pick(count)

    def integers(self, *args: Any, **kwargs: Any) -> Any:
        return self.generator.integers(*args, **kwargs)

    def normal(self, *args: Any, **kwargs: Any) -> Any:
        return self.generator.normal(*args, **kwargs)

    def random(self, *args: Any, **kwargs: Any) -> Any:
        return self.generator.random(*args, **kwargs)


def _torch_after_model(seed: int, module: nn.Module) -> torch.Generator:
    """torch's global generator as their main.py leaves it before the first DataLoader: seeded, the model's
    layers initialized in order, the projection matrix drawn (the global generator itself is left as it was)."""
    saved = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        reset_parameters(module)
        size = sum(p.numel() for p in module.parameters())
        torch.normal(mean=0.0, std=1.0, size=(PROJECTION_ROWS, size))
        state = torch.random.get_rng_state()
    finally:
        torch.random.set_rng_state(saved)
    generator = torch.Generator()
    generator.set_state(state)
    return generator
