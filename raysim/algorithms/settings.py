"""The settings algorithms share: the strict base every algorithm's settings extend (its `name` chooses them), a
learning rate that decays by round, local mini-batch SGD and local work counted in steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import ConfigDict, Field, field_validator

from raysim.algorithms.requests import (
    LocalSGD,
    Number,
    Vector,
    batch_steps,
    scale_loss,
)
from raysim.algorithms.terms import Term
from raysim.settings import Settings

if TYPE_CHECKING:
    from typing_extensions import Self


class AlgorithmSettings(Settings):
    """Hyperparameters of one algorithm; subclasses add theirs. Validated from the config's `algorithm`."""

    model_config = ConfigDict(populate_by_name=True)
    name: str

    def at_round(self, round_index: int) -> Self:
        """The settings a client step of round `round_index` uses (`Algorithm.at_round`): these (see LrSchedule)."""
        return self


class LrSchedule(AlgorithmSettings):
    """A local learning rate `lr` that decays every round: eta_t = lr * lr_decay^t at round t (0-based), FedSLR's
    0.998^t (FedSLR, App. B) for any method. The runtime hands each round's client steps the settings of that round
    (`at_round`), so a step reads its round's rates as `settings.lr` wherever it uses them (SGD requests, its own
    loops, control variates)."""

    lr: float
    lr_decay: float = Field(1.0, gt=0, le=1, description="eta_t = lr * lr_decay^t at round t; 1: a constant rate")
    decayed_rates: ClassVar[tuple[str, ...]] = ("lr",)
    """The client-side rates that decay with `lr` (an unset optional one follows `lr` already)."""

    def at_round(self, round_index: int) -> Self:
        """These settings with every rate of `decayed_rates` times lr_decay^round_index."""
        if self.lr_decay == 1.0 or round_index == 0:
            return self
        factor = self.lr_decay**round_index
        rates = {name: getattr(self, name) for name in self.decayed_rates}
        return self.model_copy(update={name: rate * factor for name, rate in rates.items() if rate is not None})


class SGDSettings(LrSchedule):
    """Local mini-batch SGD, shared by the algorithms that train locally."""

    epochs: int = Field(1, ge=1, description="H: local passes over the client's training split per round")
    lr: float = Field(0.01, gt=0, description="eta: local learning rate (at round 0 with lr_decay)")
    batch_size: int = Field(100, ge=1, description="samples of each mini-batch of local SGD")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (0.5 in the FLAME authors' code)")
    weight_decay: float = Field(0.0, ge=0, description="extra L2 term mu*theta (0.01 in the FLAME authors' code)")
    random_epochs: bool = Field(
        False,
        description="each local training draws its passes uniformly from 1..epochs (per client and round, from the "
        "client's seeded stream) instead of always `epochs`: the FLAME authors' --fixed 0, E = random.randint(1, "
        "local_ep) (the FLAME authors' code); an algorithm training several times a round draws for each",
    )
    loss_scale: Literal["1", "1/m"] = Field(
        "1",
        description="weight of the loss and its weight_decay term in the local objective: 1, or 1/m (m training "
        "clients) as the FedAPM authors' code divides every gradient, g = (1/m)(grad f_i + mu w); "
        "proximal, dual and linear terms stay unscaled. Step-matches a method with FedAPM at alpha_i = 1/m",
    )

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale_one(cls, value: Any) -> Any:
        """`loss_scale: 1` as a YAML number means "1"."""
        return "1" if isinstance(value, int | float) and not isinstance(value, bool) and value == 1 else value

    def loss_factor(self, num_clients: int) -> float:
        """The loss weight that `loss_scale` gives with m = `num_clients` training clients."""
        return 1.0 / num_clients if self.loss_scale == "1/m" else 1.0

    def scaled(self, request: LocalSGD, num_clients: int) -> LocalSGD:
        """`request` with its loss weighted by `loss_scale` (see `scale_loss`)."""
        return scale_loss(request, self.loss_factor(num_clients))

    def effective_lr(self, num_clients: int, weighting: str) -> str:
        """The step on the unweighted loss f_i, lr times the loss's weight, as the run's parameters state it."""
        return f"{self.lr * self.loss_factor(num_clients):.6g}"

    def local_sgd(
        self, start: Vector, epochs: int | None = None, terms: tuple[Term, ...] = (), **options: Any
    ) -> LocalSGD:
        """A LocalSGD request with these hyperparameters on f_i + `terms`; `options` sets its other fields (mask,
        in_place)."""
        return LocalSGD(
            start=start,
            epochs=self.epochs if epochs is None else epochs,
            lr=self.lr,
            batch_size=self.batch_size,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            terms=terms,
            random_epochs=self.random_epochs,
            **options,
        )


class LocalStepsSettings(LrSchedule):
    """Local work counted in steps that each draw fresh batches (BatchGradients: Per-FedAvg, APFL), not in passes."""

    batch_size: int = Field(100, ge=1, description="samples of each batch a step draws")
    epochs: int = Field(1, ge=1, description="local passes over the training split per round (sets local_steps)")
    local_steps: int | None = Field(
        None,
        ge=1,
        description="local steps per round; default epochs * ceil(n_i / batch_size) // the batches one step draws "
        "(APFL 1; Per-FedAvg 2 for FO, 3 for HF: FL-bench's count)",
    )

    def step_counts(self, num_train: Number, batches_per_step: int = 1) -> np.ndarray:
        """Local steps per round of a client (one per row of a chunk): `local_steps`, else `batch_steps`."""
        if self.local_steps is not None:
            return np.full(np.shape(num_train), self.local_steps, np.int64)
        return batch_steps(num_train, self.batch_size, self.epochs, batches_per_step)
