"""Malicious clients (FLAME, Sec. VI): Byzantine messages and label poisoning.

A fraction of the clients, drawn once per run from the seed, is malicious. Byzantine attackers run the
honest client step and then replace the message the paper says they upload (FLAME u_i, FedAvg the
local model; see `Upload`) with:

    same_value:  p 1_d,        p ~ N(0, gamma^2)
    sign_flip:   -|p| u_i,     p ~ N(0, gamma^2)   (u_i the honest message; `sign_flip_base: global` uses w^t)
    gaussian:    N(0, gamma^2 I_d)

gamma^2 = 0.1 in the paper; the authors' code uses std 0.01 (same_value), |N(0, 1)| (sign_flip) and
N(0, 1) (gaussian): `noise: code`. The authors' code also attacks with max(int(f m), 1) clients (`count: code`)
and its Byzantine clients skip local training (`training: skip`: every LocalSGD request returns its start
point, the step's new state is discarded, so the honest message sign_flip scales is the untrained one, e.g.
FedAvg's w^t as in the code). Label poisoners train on uniformly random labels, redrawn at every
access (as the authors' code does), and then follow the protocol. Attackers are still aggregated; all
accuracy and fairness metrics are over benign clients only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.requests import Vector
from raysim.errors import ConfigError
from raysim.registry import OneOf, Registry
from raysim.seeding import Stream, rng
from raysim.settings import Settings

PAPER_STD = math.sqrt(0.1)


class AttackKind:
    """An `attack.kind`: a subclass sets `kind`, and a Byzantine one (`byzantine`) forges the message its attackers
    upload instead of the honest one; registered with `@ATTACKS.register()`."""

    kind: ClassVar[str]
    byzantine: ClassVar[bool] = True
    code_std: ClassVar[float] = 1.0
    """gamma with `attack.noise: code` (the FLAME authors' code's noise for its attacks)."""

    @staticmethod
    def forge(settings: AttackSettings, honest: Vector, broadcast: object, generator: np.random.Generator) -> Vector:
        """The message replacing `honest` (float32, its shape); `broadcast` is what the server sent this round;
        noise from `generator`, keyed by (seed, client, round)."""
        raise ValueError("this attack kind does not replace messages")


ATTACKS: Registry[type[AttackKind]] = Registry("attack kind", "attack.kind")
"""The attack kinds by `attack.kind` (AttackKind subclasses)."""


@ATTACKS.register()
class NoAttack(AttackKind):
    """Every client is honest."""

    kind = "none"
    byzantine = False


@ATTACKS.register()
class LabelPoisoning(AttackKind):
    """The attackers train on uniformly random labels and then follow the protocol."""

    kind = "label_poisoning"
    byzantine = False


@ATTACKS.register()
class SameValue(AttackKind):
    """Every coordinate p, p ~ N(0, gamma^2)."""

    kind = "same_value"
    code_std = 0.01

    @staticmethod
    def forge(settings, honest, broadcast, generator):
        return np.full(honest.shape, settings.gamma() * generator.standard_normal(), dtype=np.float32)


@ATTACKS.register()
class SignFlip(AttackKind):
    """-|p| times the honest message (or, `sign_flip_base: global`, the global model), p ~ N(0, gamma^2)."""

    kind = "sign_flip"

    @staticmethod
    def forge(settings, honest, broadcast, generator):
        base = honest
        if settings.sign_flip_base == "global":
            if not isinstance(broadcast, np.ndarray) or broadcast.shape != honest.shape:
                raise ValueError("attack.sign_flip_base=global needs an algorithm that broadcasts the global model")
            base = broadcast
        return (-abs(settings.gamma() * generator.standard_normal()) * np.asarray(base)).astype(np.float32)


@ATTACKS.register()
class Gaussian(AttackKind):
    """N(0, gamma^2 I_d)."""

    kind = "gaussian"

    @staticmethod
    def forge(settings, honest, broadcast, generator):
        return (settings.gamma() * generator.standard_normal(honest.shape)).astype(np.float32)


class AttackSettings(Settings):
    """The config's `attack` section."""

    kind: Annotated[str, OneOf(ATTACKS)] = Field(
        "none", description="what the malicious clients do (see the module docstring of raysim.threats.attacks)"
    )
    fraction: float = Field(0.0, ge=0.0, le=1.0, description="share of malicious clients: floor(fraction * m)")
    count: Literal["paper", "code"] = Field(
        "paper", description="number of attackers: int(fraction * m) (paper) or max(int(fraction * m), 1) (code)"
    )
    training: Literal["train", "skip"] = Field(
        "train",
        description="Byzantine attackers run the honest client step before forging (paper: sign_flip scales the "
        "honest message) or skip local training and keep their state (authors' code)",
    )
    noise: Literal["paper", "code"] = Field(
        "paper", description="gamma: sqrt(0.1) for every attack (paper) or the authors' code's 0.01 / 1 / 1"
    )
    std: float | None = Field(None, gt=0.0, description="gamma, overriding `noise`")
    sign_flip_base: Literal["message", "global"] = Field(
        "message", description="sign_flip scales the honest message (paper) or the received global model (code)"
    )
    labels: Literal["per_access", "fixed"] = Field(
        "per_access", description="label_poisoning: random labels redrawn at every access (code) or drawn once"
    )

    @property
    def active(self) -> bool:
        return self.kind != "none" and (self.fraction > 0 or self.count == "code")

    @property
    def byzantine(self) -> bool:
        return ATTACKS.get(self.kind).byzantine

    def gamma(self) -> float:
        if self.std is not None:
            return self.std
        return PAPER_STD if self.noise == "paper" else ATTACKS.get(self.kind).code_std

    def num_malicious(self, num_clients: int) -> int:
        """floor(fraction * m) (FLAME, Sec. VI; the 1e-9 keeps e.g. 0.29 * 100 at 29 where Python's int() of the
        float product gives 28), at least 1 with `count: code` (the authors' code attacks even at fraction 0)."""
        if self.kind == "none":
            return 0
        count = int(math.floor(self.fraction * num_clients + 1e-9))
        return max(count, 1) if self.count == "code" else count


@dataclass(frozen=True)
class AttackPlan:
    """Who attacks in this run, and how; what the hosts need."""

    settings: AttackSettings
    malicious: frozenset[int]
    seed: int

    def byzantine(self, client_id: int) -> bool:
        return self.settings.byzantine and client_id in self.malicious

    def skips_training(self, client_id: int) -> bool:
        """A Byzantine client of `training: skip`: no local work, state kept, only the forged message goes up."""
        return self.settings.training == "skip" and self.byzantine(client_id)

    def poisons_labels(self, client_id: int) -> bool:
        return self.settings.kind == "label_poisoning" and client_id in self.malicious

    def poisoned_labels(self, client_id: int, y: np.ndarray, indices: np.ndarray, num_classes: int) -> np.ndarray:
        """For `labels: fixed`: a copy of `y` with this client's samples relabelled once, uniformly at random."""
        poisoned = y.copy()
        generator = rng(self.seed, Stream.ATTACK, 2, client_id)
        poisoned[indices] = generator.integers(0, num_classes, size=len(indices))
        return poisoned

    def corrupt(self, client_id: int, round_index: int, honest: Vector, broadcast: object) -> Vector:
        """The Byzantine message replacing `honest`, with noise keyed by (seed, client, round)."""
        return byzantine_message(
            self.settings, honest, broadcast, rng(self.seed, Stream.ATTACK, 1, client_id, round_index)
        )


def malicious_clients(settings: AttackSettings, num_clients: int, seed: int) -> frozenset[int]:
    """The malicious set, drawn once per run, uniformly without replacement (FLAME, Sec. VI)."""
    count = settings.num_malicious(num_clients)
    chosen = rng(seed, Stream.ATTACK).choice(num_clients, count, replace=False)
    return frozenset(int(c) for c in chosen)


def check_benign_left(settings: AttackSettings, num_clients: int) -> None:
    """Refuse an attack that makes every client malicious: every metric is over benign clients, so such a
    run could score nothing (checked before any Ray work)."""
    count = settings.num_malicious(num_clients)
    if count >= num_clients:
        raise ConfigError(
            f"attack.fraction={settings.fraction} (attack.count={settings.count}) makes all {num_clients} clients "
            "malicious, so no benign client would be left to score; allowed: attack.fraction < 1 (with "
            "attack.count=code also at least 2 clients)"
        )


def attack_plan(
    settings: AttackSettings, num_clients: int, seed: int, marked: frozenset[int] | None = None
) -> AttackPlan:
    """The run's attackers: drawn from the seed, or the clients a partition file marks (`marked`, when it marks
    any); a ConfigError when they would be all the clients (see check_benign_left)."""
    if marked:
        if len(marked) >= num_clients:
            raise ConfigError(f"the partition file marks all {num_clients} clients malicious; no benign client is left")
        return AttackPlan(settings, marked, seed)
    check_benign_left(settings, num_clients)
    return AttackPlan(settings, malicious_clients(settings, num_clients, seed), seed)


def byzantine_message(
    settings: AttackSettings, honest: Vector, broadcast: object, generator: np.random.Generator
) -> Vector:
    """One Byzantine message (see the module docstring and the kind's `forge`), the shape of `honest`."""
    attack = ATTACKS.get(settings.kind)
    if not attack.byzantine:
        raise ValueError(f"attack.kind={settings.kind!r} does not replace messages")
    return attack.forge(settings, honest, broadcast, generator)
