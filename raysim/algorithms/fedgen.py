"""FedGen: FedAvg whose clients are regularized by a server-side generator of features (Zhu, Hong and Zhou,
"Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021, arXiv:2105.10056, Algorithm 1).

The model is split at its head (ParamSpec.head, the last linear layer): its input is the features z = f(x). The
server holds a conditional generator G_w(z | y) into that feature space and learns it, without data, from the
clients' heads: G's features of a label y should be classified as y by the ensemble of the round's heads, each
client's head weighted by its share of the label (eq. 4-5),

    min_w  E_{y ~ p^(y), eps}  sum_k alpha_{k,y} CE(h_k(G_w(y, eps)), y)  +  eta * L_div,
    alpha_{k,y} = c_{k,y} / sum_j c_{j,y},

with c_{k,y} client k's count of label y (over the round's selected clients) and L_div the authors' diversity loss
exp(-mean_{i,j} ||eps_i - eps_j||^2_mean |z_i - z_j|_mean) over a batch (`diversity` = eta, 1 in their code).
`ensemble: logits` takes instead the cross-entropy of the weighted ensemble's logits, CE(sum_k alpha_{k,y}
h_k(z), y) (one prediction of the ensemble, as the authors' code forms it for its student loss). A selected client
receives the global model and G, and trains on its data with eq. 6's regularizer added at every step,

    CE(h(f(x)), y) + alpha_t (B'/B) CE(h(G_w(y^, eps)), y^) [+ beta_t KL(softmax(h(G_w(y, eps'))) || softmax(h(f(x))))]

on B' = `synthetic_batch_size` labels y^ drawn from the global label distribution p^(y) (the counts the clients
uploaded, the latest of each) and fresh noise, G held constant (the gradient reaches only the head). The weights
decay by round as the authors' code decays them, alpha_t = max(1e-4, alpha 0.98^t), with their alpha = 10 and
their ratio B'/B of synthetic to real batch sizes (`gen_ratio`); the bracketed term, the authors' "latent loss"
that pulls the predictions on the real batch towards the head's on generated features of the same labels, is not
in the paper: `beta` = 0 by default (the authors' code: 10, FL-bench too). The regularizer starts once the
generator has been trained (round 1 on, as in the authors' code). Each client uploads its model times n_i, n_i and
its label counts c_k; the server averages the models weighted by n_i (FedAvg) and takes `generator_steps` Adam
steps on G with the round's heads (the head of each uploaded model), which it reads by client (`reads_messages`:
Byzantine attacks and robust rules are refused). With alpha = beta = 0 the clients never use G: FedAvg.

The generator is the authors' (zhuangdizhu/FedGen generator.py): [eps, onehot(y)] -> Linear(noise_dim + classes,
hidden) -> BatchNorm -> ReLU -> Linear(hidden, d), with eps ~ U[0, 1) (torch.rand, though their comment says
Gaussian; FL-bench draws N(0, 1): `noise: normal`), PyTorch's default initialization drawn from a generator seeded
by the model's initial parameters. The server trains it in train mode (batch statistics, updating the running
ones); the clients use the running statistics, as the authors' clients evaluate it in eval mode (`batch_norm:
false`: no BatchNorm). Defaults are their MNIST configuration (RUNCONFIGS, GENERATORCONFIGS: hidden 256, noise 32,
Adam at 3e-4 decayed by 0.98 per round with weight decay 1e-2, 50 steps of 32 labels per round, eta 1); d is the
model's feature dimension. Server labels y are drawn from the selected clients' label counts (p^(y) of eq. 4,
`label_sampling: prior`) or uniformly among the labels they hold (`uniform`: the authors' `qualified_labels`, which
ask a client for more than one sample); the clients' y^ likewise from the global counts (`uniform`: among every label
held, the authors' `available_labels`). PFLlib's FedGen differs again (the heads' logits weighted by n_i, no
diversity loss, the regularizer at weight 1 without decay): not offered.

Downlink: the model, G's parameters and running statistics and p^(y) (classes). Uplink: the model, n_i and c_k
(the head is part of the model). GM = the averaged model; there is no personalized model. The server's draws come
from a generator keyed by the seed and the round, so its step is deterministic; a client's from its stream (the
term draws at every step). The local loss is this module's term (`GeneratedFeaturesLoss`), one client at a time.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import (
    ALGORITHMS,
    NOT_SENT,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerReadsEachMessage,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import ClassMeans, Vector, class_means, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel

COEFFICIENT_FLOOR = 1e-4
"""The authors' floor of the decayed alpha_t and beta_t (`exp_lr_scheduler`: max(1e-4, ...))."""
BATCH_NORM_MOMENTUM, BATCH_NORM_EPS = 0.1, 1e-5
"""torch.nn.BatchNorm1d's defaults, as the authors' generator leaves them."""
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8
"""The authors' Adam (betas (0.9, 0.999), eps 1e-8)."""
CLIENT_DRAWS = 0x6E6
"""Keys a client step's generator draws apart from the network's dropout, which the same seed seeds."""


class FedGenSettings(SGDSettings):
    name: Literal["fedgen"] = "fedgen"
    alpha: float = Field(
        10.0, ge=0, description="alpha: weight of eq. 6's CE on generated features (the authors' generative_alpha)"
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="beta: weight of the authors' latent KL term, not in the paper (their generative_beta: 10)",
    )
    coefficient_decay: float = Field(
        0.98, gt=0, le=1, description="alpha_t = max(1e-4, alpha * decay^t), beta_t likewise (the authors' 0.98)"
    )
    synthetic_batch_size: int = Field(
        32, ge=1, description="B': generated features per local step (gen_batch_size); the term is weighted B'/B"
    )
    noise_dim: int = Field(32, ge=1, description="dimension of the generator's noise eps (the authors' MNIST: 32)")
    hidden_dim: int = Field(256, ge=1, description="width of the generator's hidden layer (the authors' MNIST: 256)")
    batch_norm: bool = Field(True, description="BatchNorm after the generator's hidden layer (the authors' code)")
    noise: Literal["uniform", "normal"] = Field(
        "uniform", description="eps ~ U[0, 1) (the authors' torch.rand) or N(0, 1) (FL-bench)"
    )
    generator_lr: float = Field(3e-4, gt=0, description="the generator's Adam rate (the authors' MNIST ensemble_lr)")
    generator_lr_decay: float = Field(
        0.98, gt=0, le=1, description="the generator's rate times this every round (the authors' ExponentialLR)"
    )
    generator_weight_decay: float = Field(
        1e-2, ge=0, description="L2 term of the generator's Adam (the authors' MNIST weight_decay)"
    )
    generator_steps: int = Field(
        50, ge=1, description="generator steps per round (the authors' ensemble_epochs 50: 10 x 5 teacher iterations)"
    )
    generator_batch_size: int = Field(
        32, ge=2, description="labels per generator step (the authors' batch_size 32; BatchNorm needs 2)"
    )
    diversity: float = Field(1.0, ge=0, description="eta: weight of the diversity loss (the authors' ensemble_eta)")
    ensemble: Literal["losses", "logits"] = Field(
        "losses",
        description="the generator's loss: sum_k alpha_{k,y} CE(h_k(z), y) (the authors' teacher_loss) or "
        "CE(sum_k alpha_{k,y} h_k(z), y), the weighted ensemble's logits",
    )
    label_sampling: Literal["prior", "uniform"] = Field(
        "prior",
        description="labels of generated features: from the label counts (p^(y), eq. 4 and 6) or uniformly among "
        "the labels held (the authors' code)",
    )


@dataclass(frozen=True)
class Generator:
    """The conditional generator's layout: its flat parameters are the first Linear layer's weight [hidden, noise +
    classes] and bias, BatchNorm's weight and bias (with `batch_norm`), the second Linear layer's weight [features,
    hidden] and bias (torch's layouts); its running statistics, apart, are BatchNorm's running mean then variance."""

    noise_dim: int
    classes: int
    hidden_dim: int
    features: int
    batch_norm: bool

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        hidden, inputs = self.hidden_dim, self.noise_dim + self.classes
        norm = [(hidden,), (hidden,)] if self.batch_norm else []
        return [(hidden, inputs), (hidden,), *norm, (self.features, hidden), (self.features,)]

    @property
    def size(self) -> int:
        return sum(int(np.prod(shape)) for shape in self.shapes)

    @property
    def statistics_size(self) -> int:
        return 2 * self.hidden_dim if self.batch_norm else 0

    def split(self, phi: Any) -> list[Any]:
        """The parameter tensors, views of phi."""
        parts, offset = [], 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            parts.append(phi[offset : offset + size].reshape(shape))
            offset += size
        return parts

    def initial(self, rng: np.random.Generator) -> tuple[Vector, Vector]:
        """PyTorch's default initialization (Linear: weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)); BatchNorm:
        weight 1, bias 0, running mean 0, running variance 1): the parameters and the running statistics."""
        parts = []
        for shape in self.shapes:
            if len(shape) == 2:
                bound = 1.0 / np.sqrt(shape[1])
                parts += [rng.uniform(-bound, bound, int(np.prod(shape))), rng.uniform(-bound, bound, shape[0])]
        if self.batch_norm:
            parts[2:2] = [np.ones(self.hidden_dim), np.zeros(self.hidden_dim)]
        statistics = [np.zeros(self.hidden_dim), np.ones(self.hidden_dim)] if self.batch_norm else []
        return np.concatenate(parts).astype(np.float32), np.concatenate([[], *statistics]).astype(np.float32)

    def draw(self, rng: np.random.Generator, labels: np.ndarray, count: int, noise: str) -> tuple[Vector, Vector]:
        """`count` labels from the distribution `labels` [classes] and their noise [count, noise_dim] (float32)."""
        drawn = rng.choice(self.classes, size=count, p=labels / labels.sum())
        shape = (count, self.noise_dim)
        eps = rng.random(shape) if noise == "uniform" else rng.standard_normal(shape)
        return drawn, eps.astype(np.float32)

    def forward(
        self, phi: torch.Tensor, statistics: torch.Tensor, labels: torch.Tensor, noise: torch.Tensor, training: bool
    ) -> torch.Tensor:
        """G(y, eps) [count, features]: BatchNorm on the batch's statistics while `training` (writing the running
        ones into `statistics` in place, as torch's layer does), else on the running ones."""
        import torch
        from torch.nn import functional

        parts = self.split(phi)
        inputs = torch.cat([noise, functional.one_hot(labels, self.classes).to(noise.dtype)], dim=1)
        hidden = functional.linear(inputs, parts[0], parts[1])
        if self.batch_norm:
            mean, variance = statistics[: self.hidden_dim], statistics[self.hidden_dim :]
            hidden = functional.batch_norm(
                hidden, mean, variance, parts[2], parts[3], training, BATCH_NORM_MOMENTUM, BATCH_NORM_EPS
            )
        return functional.linear(torch.relu(hidden), parts[-2], parts[-1])


def diversity_loss(noise: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The authors' DiversityLoss('l1'): exp(-mean_{i,j} d_eps(i, j) d_z(i, j)) with d_eps the mean squared and d_z
    the mean absolute difference of rows i and j: small when distant noises give distant features."""
    import torch

    noise_distance = (noise[None, :, :] - noise[:, None, :]).pow(2).mean(dim=2)
    feature_distance = (features[None, :, :] - features[:, None, :]).abs().mean(dim=2)
    return torch.exp(-(noise_distance * feature_distance).mean())


def label_weights(counts: np.ndarray) -> np.ndarray:
    """alpha [k, classes]: each client's share of each label, c_{k,y} / sum_j c_{j,y} (0 for a label no one holds)."""
    counts = np.asarray(counts, np.float64)
    held = counts.sum(axis=0)
    return np.where(held > 0, counts / np.where(held > 0, held, 1.0), 0.0)


def ensemble_loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    biases: torch.Tensor | None,
    alpha: torch.Tensor,
    ensemble: str,
) -> torch.Tensor:
    """The generator's loss on features [B, d] of `labels` [B] under k heads (weights [k, classes, d], biases
    [k, classes] or None), alpha [k, classes] the label weights: the batch mean of sum_k alpha_{k,y} CE(h_k(z), y)
    (`losses`, eq. 5), or of CE(sum_k alpha_{k,y} h_k(z), y) (`logits`)."""
    import torch
    from torch.nn import functional

    logits = torch.einsum("bd,kcd->kbc", features, weights)
    if biases is not None:
        logits = logits + biases[:, None, :]
    shares = alpha[:, labels]  # [k, B]
    if ensemble == "logits":
        return functional.cross_entropy((shares[:, :, None] * logits).sum(dim=0), labels)
    losses = torch.stack([functional.cross_entropy(each, labels, reduction="none") for each in logits])
    return (shares * losses).sum(dim=0).mean()


def split_head(spec: ParamSpec, head: Any) -> tuple[Any, Any | None]:
    """A head vector (ParamSpec.head's layout: weight, then bias if any) as (weight [classes, d], bias or None);
    also a stack of them [k, head size] ([k, classes, d], [k, classes])."""
    leading = tuple(head.shape[:-1])
    classes, d = spec.head_outputs, spec.feature_dim
    weight = head[..., : classes * d].reshape(*leading, classes, d)
    return weight, (head[..., classes * d :] if len(spec.require_head()) > 1 else None)


@dataclass(frozen=True, eq=False)
class GeneratedFeaturesLoss(Term):
    """Eq. 6's local loss in place of f_i, on a batch (x, y) of B samples:

        CE(h(f(x)), y) + alpha CE(h(G(y^, eps)), y^) + beta KL(softmax(h(G(y, eps'))) || softmax(h(f(x))))

    with B' labels y^ drawn from `labels` and noises eps, eps' drawn afresh at every step (from the step's seed),
    G the generator (constants: no gradient reaches it, the KL's target is detached) evaluated on its running
    statistics, h the head at the point trained; `alpha` includes the ratio B'/B."""

    generator: np.ndarray
    statistics: np.ndarray
    layout: Generator
    labels: np.ndarray
    """[classes]: the distribution of y^."""
    alpha: float
    beta: float
    synthetic: int
    """B'."""
    noise: str
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False
    shared: ClassVar[tuple[str, ...]] = ("generator", "statistics")

    @property
    def draws(self) -> bool:
        """Labels and noise are drawn at every step."""
        return True

    def draw(self, seed: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's draws: y^ [B'], eps [B', noise] and eps' [count, noise] (the real batch's noise)."""
        rng = np.random.default_rng([seed, CLIENT_DRAWS])
        sampled, noise = self.layout.draw(rng, np.asarray(self.labels, np.float64), self.synthetic, self.noise)
        shape = (count, self.layout.noise_dim)
        latent = rng.random(shape) if self.noise == "uniform" else rng.standard_normal(shape)
        return sampled, noise, latent.astype(np.float32)

    def generated(self, labels: np.ndarray, noise: np.ndarray) -> torch.Tensor:
        """G(y, eps) with the running statistics, no gradient."""
        import torch

        with torch.no_grad():
            return self.layout.forward(
                self.tensor("generator"),
                self.tensor("statistics"),
                torch.from_numpy(np.asarray(labels, np.int64)),
                torch.from_numpy(noise),
                training=False,
            )

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch.nn import functional

        if model.task != "classification":
            raise ValueError(f"FedGen's loss needs a classifier; model {model.name!r} is trained for {model.task}")
        if seed is None:
            raise ValueError("GeneratedFeaturesLoss: the generator's draws need the step's seed")
        with model.dropout(seed):
            _, logits = model.features(point, x)
        total = functional.cross_entropy(logits, y)
        device = logits.device
        spec, names = model.spec, model.spec.require_head()
        weight = point[spec.slice(names[0])].reshape(spec.head_outputs, spec.feature_dim)
        bias = point[spec.slice(names[1])] if len(names) > 1 else None
        sampled, noise, latent = self.draw(seed, len(y))
        if self.alpha:
            generated = functional.linear(self.generated(sampled, noise).to(device), weight, bias)
            targets = torch.from_numpy(sampled).to(device)
            total = total + self.alpha * functional.cross_entropy(generated, targets)
        if self.beta:
            features = self.generated(y.cpu().numpy(), latent).to(device)
            target = functional.softmax(functional.linear(features, weight, bias), dim=1)
            kl = functional.kl_div(functional.log_softmax(logits, dim=1), target.detach(), reduction="batchmean")
            total = total + self.beta * kl
        return total


@dataclass
class FedGenClientState:
    """Nothing is kept on a client between rounds."""


@dataclass
class FedGenBroadcast:
    model: Vector
    generator: Vector
    """G's parameters (Generator's layout)."""
    statistics: Vector
    """G's BatchNorm running mean and variance (empty without BatchNorm)."""
    labels: np.ndarray
    """[classes] float64: the distribution clients draw y^ from (zero before the generator's first training)."""
    round: int = field(default=0, metadata=NOT_SENT)
    """t, for alpha_t and beta_t (every client knows the round)."""


@dataclass
class FedGenUpload(Upload):
    """The model times n_i and n_i (summed: FedAvg), the label counts c_k; the server reads the head and counts by
    client (`message`). It names no message field: Byzantine attacks and robust rules are refused."""

    weighted: Vector
    """n_i theta_i (float64)."""
    weight: float
    counts: np.ndarray
    """[classes] float64: c_k."""
    head: Vector = field(metadata=NOT_SENT)
    """The trained model's head: a part of `weighted`, not sent twice."""


@dataclass
class FedGenServerState:
    model: Vector
    generator: Vector
    statistics: Vector
    first: Vector
    """Adam's first moment of the generator (zeros before its first step)."""
    second: Vector
    """Adam's second moment."""
    label_counts: np.ndarray
    """[m, classes] float64: the label counts each client last uploaded (zeros before)."""
    seed: int
    """Keys the server's draws (with the round)."""
    steps: int = 0
    """Adam steps taken."""
    rounds: int = 0
    """Server steps taken: t."""


@ALGORITHMS.register()
class FedGen(
    ServerReadsEachMessage[FedGenSettings, FedGenClientState, FedGenServerState, FedGenBroadcast, FedGenUpload]
):
    """FedAvg, plus a server-side generator of features that the clients' heads learn to classify (eq. 6)."""

    name = "fedgen"
    Settings = FedGenSettings
    Upload = FedGenUpload

    def __init__(self, settings: FedGenSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.head = params.head_mask()
        s = settings
        self.layout = Generator(s.noise_dim, params.head_outputs, s.hidden_dim, params.feature_dim, s.batch_norm)

    def init_server(self, init_params: Vector, num_clients: int) -> FedGenServerState:
        seed = zlib.crc32(np.ascontiguousarray(init_params).tobytes())
        generator, statistics = self.layout.initial(np.random.default_rng(seed))
        counts = np.zeros((num_clients, self.layout.classes))
        moments = np.zeros_like(generator), np.zeros_like(generator)
        return FedGenServerState(init_params.copy(), generator, statistics, *moments, counts, seed)

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedGenClientState:
        return FedGenClientState()

    def sampling(self, counts: np.ndarray) -> np.ndarray:
        """The distribution labels are drawn from, given label counts [classes] (`label_sampling`)."""
        if self.settings.label_sampling == "uniform":
            return (counts > 0).astype(np.float64)
        return np.asarray(counts, np.float64)

    def broadcast(self, server: FedGenServerState) -> FedGenBroadcast:
        labels = self.sampling(server.label_counts.sum(axis=0)) if server.rounds else np.zeros(self.layout.classes)
        total = labels.sum()
        labels = labels / total if total > 0 else labels
        return FedGenBroadcast(server.model, server.generator, server.statistics, labels, server.rounds)

    def coefficient(self, initial: float, round_index: int) -> float:
        """alpha_t or beta_t: max(1e-4, initial * decay^t), 0 for an initial weight 0."""
        if not initial:
            return 0.0
        return max(COEFFICIENT_FLOOR, initial * self.settings.coefficient_decay**round_index)

    def regularizer(self, received: FedGenBroadcast) -> GeneratedFeaturesLoss | None:
        """The round's local loss, or None where the clients train on plain CE (no weight, or no generator yet)."""
        s = self.settings
        alpha = self.coefficient(s.alpha, received.round) * s.synthetic_batch_size / s.batch_size
        beta = self.coefficient(s.beta, received.round)
        if not (alpha or beta) or not received.labels.any():
            return None
        return GeneratedFeaturesLoss(
            received.generator,
            received.statistics,
            self.layout,
            received.labels,
            alpha,
            beta,
            s.synthetic_batch_size,
            s.noise,
        )

    def client_step(self, client: ClientInfo, state: FedGenClientState, received: FedGenBroadcast) -> ClientStep:
        """The label counts c_k, then local SGD from the global model on CE plus eq. 6's regularizer."""
        counts = yield from class_means(ClassMeans(None))
        term = self.regularizer(received)
        result = yield from train(self.settings.local_sgd(received.model, terms=() if term is None else (term,)))
        theta = np.asarray(result.params, np.float32)
        n = float(client.num_train)
        upload = FedGenUpload(n * theta.astype(np.float64), n, counts.counts.astype(np.float64), theta[self.head])
        return ClientUpdate(state, upload, {"train_loss": result.mean_loss})

    def message(self, update: ClientUpdate) -> Vector:
        """The trained head and the label counts, which the server reads by client."""
        return np.concatenate([update.upload.head, update.upload.counts])

    def server_step_by_client(
        self, server: FedGenServerState, total: FedGenUpload, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[FedGenServerState, dict[str, float]]:
        """FedAvg of the models (n_i weighted), then the generator's steps on the round's heads (eq. 4-5)."""
        model = (total.weighted / total.weight).astype(np.float32) if total.weight > 0 else server.model
        metrics = server_metrics(model, server.model)
        ids = sorted(messages)
        size = int(self.head.sum())
        rows = np.stack([np.asarray(messages[c], np.float64) for c in ids]) if ids else np.zeros((0, size))
        heads, counts = rows[:, :size], rows[:, size:]
        label_counts = server.label_counts.copy()
        label_counts[ids] = counts
        state = FedGenServerState(
            model,
            server.generator,
            server.statistics,
            server.first,
            server.second,
            label_counts,
            server.seed,
            server.steps,
            server.rounds + 1,
        )
        if counts.any():
            state, generator_metrics = self.train_generator(state, server.rounds, heads, counts)
            metrics.update(generator_metrics)
        return state, metrics

    def train_generator(
        self, state: FedGenServerState, round_index: int, heads: np.ndarray, counts: np.ndarray
    ) -> tuple[FedGenServerState, dict[str, float]]:
        """`generator_steps` Adam steps (torch.optim.Adam with the state's moments) on the ensemble loss of the heads
        [k, head size] weighted by the label counts [k, classes] plus eta times the diversity loss, labels from the
        counts (`label_sampling`), at the rate generator_lr * generator_lr_decay^t; returns the state with the new
        generator, its running statistics and moments, and the mean losses."""
        import torch

        s = self.settings
        rng = np.random.default_rng([state.seed, round_index])
        labels = self.sampling(counts.sum(axis=0))
        alpha = torch.tensor(label_weights(counts), dtype=torch.float32)
        weights, biases = split_head(self.params, torch.tensor(heads, dtype=torch.float32))
        phi = torch.tensor(state.generator, requires_grad=True)
        statistics = torch.tensor(state.statistics)
        lr = s.generator_lr * s.generator_lr_decay**round_index
        optimizer = torch.optim.Adam(
            [phi], lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=s.generator_weight_decay
        )
        if state.steps:
            optimizer.state[phi] = {
                "step": torch.tensor(float(state.steps)),
                "exp_avg": torch.tensor(state.first),
                "exp_avg_sq": torch.tensor(state.second),
            }
        teacher, diverse = [], []
        for _ in range(s.generator_steps):
            drawn, eps = self.layout.draw(rng, labels, s.generator_batch_size, s.noise)
            y, noise = torch.from_numpy(drawn), torch.from_numpy(eps)
            features = self.layout.forward(phi, statistics, y, noise, training=True)
            fit = ensemble_loss(features, y, weights, biases, alpha, s.ensemble)
            spread = diversity_loss(noise, features)
            optimizer.zero_grad()
            (fit + s.diversity * spread).backward()
            optimizer.step()
            teacher.append(fit.item())
            diverse.append(spread.item())
        moments = optimizer.state[phi]
        trained = FedGenServerState(
            state.model,
            phi.detach().numpy().copy(),
            statistics.numpy().copy(),
            moments["exp_avg"].numpy().copy(),
            moments["exp_avg_sq"].numpy().copy(),
            state.label_counts,
            state.seed,
            state.steps + s.generator_steps,
            state.rounds,
        )
        return trained, {"generator_loss": float(np.mean(teacher)), "diversity_loss": float(np.mean(diverse))}

    def global_model(self, server: FedGenServerState) -> Vector:
        return server.model
