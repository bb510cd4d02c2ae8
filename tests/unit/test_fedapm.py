"""FedAPM's mathematics (fedapm.md 1.3-1.5), its parameter splits, FedAlt/FedSim, and the F1/AUC metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raysim.algorithms.families.averaging import AveragingClientState
from raysim.algorithms.families.split import personal_mask
from raysim.algorithms.fedapm import FedApm, FedApmSettings
from raysim.algorithms.fedavg import FedAvg, FedAvgSettings
from raysim.algorithms.interface import ClientChunk, ClientInfo
from raysim.algorithms.requests import SGDResult
from raysim.algorithms.terms import Prox
from raysim.config import validate_config
from raysim.data.modalities import Modalities, Modality
from raysim.errors import ConfigError
from raysim.evaluation.classification import classification_scores
from raysim.evaluation.clients import ClientScorer, evaluation_data
from raysim.execution import run_client_step
from raysim.models.flat import FlatModel
from raysim.models.spec import ParamSpec
from raysim.runtime.problem import sample_clients
from raysim.training.local import ClientData, LocalTrainer
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

MLP = {"name": "mlp"}


def _fedapm(**settings) -> InProcess:
    algorithm = {"name": "fedapm", "lr": 0.1, "batch_size": 32, "epochs": 1, **settings}
    return InProcess(validate_config(tiny_config(algorithm=algorithm, model=MLP, clients={"count": 5, "per_round": 2})))


@pytest.mark.parametrize("switches", [{}, {"v_anchor": "broadcast", "u_start": "broadcast"}, {"reset_personal": True}])
def test_dual_invariant_after_every_aggregation(switches):
    """sum_i pi_i + rho sum_i (u_i - u) = 0 after every aggregation (fedapm.md 4, from eq. 79): u is the mean of
    z_i = u_i + pi_i/rho over all m clients. Holds under partial participation only if the server's running sum
    of z_i is kept exactly; float32 states give atol 1e-5 relative to rho * ||u||. With `reset_personal` (the
    authors' CIFAR code) u, pi_i and z_i cover the whole model, and so does the invariant."""
    rho = 0.5
    sim = _fedapm(rho=rho, **switches)
    shared = sim.host.algorithm.synced
    for round_index in range(4):
        sim.round(round_index)
        u = sim.server.u.astype(np.float64)
        residual = sum(s.pi + rho * (s.params[shared] - u) for s in sim.states.values())
        assert np.abs(residual).max() < 1e-5 * max(1.0, rho * np.abs(u).max())
    assert max(np.abs(s.pi).max() for s in sim.states.values()) > 1e-4  # the duals really moved


def test_personal_part_never_leaves_the_client():
    """Uplink and downlink carry only the shared part: z_i and u are shared-part sized."""
    sim = _fedapm()
    algorithm = sim.host.algorithm
    shared_size = int(algorithm.shared.sum())
    assert sim.server.u.shape == (shared_size,)
    update_bytes = algorithm.downlink_bytes(sim.coordinator.broadcast())
    assert update_bytes == 4 * shared_size < 4 * algorithm.params.size


def test_fedapm_without_dual_and_penalty_is_fedalt():
    """FedAPM with pi_i = 0, rho -> 0, sigma_i = 0, u_i <- u at round start and alpha_i = 1 is FedAlt
    (fedapm.md 1.3). Same seeds give the same mini-batches; full participation makes FedAPM's mean over all m
    clients FedAlt's mean over the selected ones. They differ only by the rho = 1e-7 prox term and float32
    rounding of the running sum: atol 1e-5."""
    sgd = {"lr": 0.1, "batch_size": 32, "epochs": 2}
    apm = InProcess(
        validate_config(
            tiny_config(
                algorithm={
                    "name": "fedapm",
                    "rho": 1e-7,
                    "sigma": 0.0,
                    "alpha": 1.0,
                    "freeze_dual": True,
                    "v_anchor": "broadcast",
                    "u_start": "broadcast",
                    **sgd,
                },
                model=MLP,
            )
        )
    )
    alt = InProcess(validate_config(tiny_config(algorithm={"name": "fedalt", **sgd}, model=MLP)))
    for round_index in range(3):
        apm.round(round_index)
        alt.round(round_index)
    assert np.linalg.norm(alt.server.u - alt.problem.init_params[alt.host.algorithm.shared]) > 0.1
    np.testing.assert_allclose(apm.server.u, alt.server.u, atol=1e-5)
    for i, state in alt.states.items():
        np.testing.assert_allclose(apm.states[i].params, state.params, atol=1e-5)


def test_fedsim_moves_both_parts_from_the_same_batches_fedalt_in_turn():
    """FedSim and FedAlt share the split and server; their local updates differ (Jacobi vs Gauss-Seidel)."""
    results = {}
    for name in ("fedalt", "fedsim"):
        sim = InProcess(validate_config(tiny_config(algorithm={"name": name, "lr": 0.1, "epochs": 1}, model=MLP)))
        sim.round(0)
        results[name] = sim.server.u
    assert np.abs(results["fedalt"] - results["fedsim"]).max() > 1e-4


def _names(model: str, shape: tuple[int, ...], classes: int = 10, **split) -> tuple[list[str], int]:
    flat = FlatModel(model, shape, classes)
    mask = personal_mask(FedApmSettings(**split), flat.spec)
    personal = [n for n in flat.spec.names if mask[flat.spec.slice(n)].all()]
    return personal, int(mask.sum())


def test_presets_reproduce_the_papers_splits():
    """`output` on the CIFAR CNN personalizes fc1 and fc2, 263,562 of 268,650 parameters (fedapm.md 2); on the
    MLP (no convolutions) the last layer; `first_layer` the input layer; patterns override presets."""
    names, count = _names("cnn", (3, 32, 32))
    assert names == ["7.weight", "7.bias", "9.weight", "9.bias"] and count == 263_562
    assert _names("mlp", (784,))[0] == ["5.weight", "5.bias"]
    assert _names("mlp", (784,), preset="first_layer")[0] == ["1.weight", "1.bias"]
    assert _names("mlp", (784,), personal=["3.*", "5.bias"])[0] == ["3.weight", "3.bias", "5.bias"]


def test_a_split_with_an_empty_part_is_rejected_naming_the_setting():
    with pytest.raises(ConfigError, match=r"algorithm.preset=.output. makes every parameter personal"):
        _names("mlr", (784,))
    with pytest.raises(ConfigError, match=r"algorithm.personal=\['fc.\*'\] makes no parameter personal"):
        _names("mlp", (784,), personal=["fc.*"])


def test_f1_and_auc_on_hand_computed_cases():
    """Weighted F1 and one-vs-rest AUC (fedapm.md 4.4). Labels [0, 0, 1, 2], argmax predictions [0, 1, 0, 2]:
    per-class F1 1/2, 0, 1 weighted by support 2, 1, 1 gives 1/2. AUC is the share of (positive, negative)
    pairs ranked right: class 0 scores 0.6, 0.2 vs 0.5, 0.1: 3/4; class 1 scores 0.4 vs 0.3, 0.7, 0.1: 2/3;
    class 2: 1. Macro mean (3/4 + 2/3 + 1)/3."""
    logits = np.log(np.array([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.5, 0.4, 0.1], [0.1, 0.1, 0.8]], dtype=np.float32))
    f1, auc = classification_scores(logits, np.array([0, 0, 1, 2]), "zero")
    assert f1 == pytest.approx(0.5)
    assert auc == pytest.approx((3 / 4 + 2 / 3 + 1) / 3)


def test_single_label_split_auc_follows_the_convention():
    """A one-label test split has no negatives: AUC 0 (FedAPM's code) or NaN (left out of means)."""
    logits = np.zeros((3, 4), np.float32)
    assert classification_scores(logits, np.array([2, 2, 2]), "zero")[1] == 0.0
    assert math.isnan(classification_scores(logits, np.array([2, 2, 2]), "nan")[1])


KUHAR = Modalities([Modality("acc", (256, 3)), Modality("gyro", (256, 3))])
CRISISMMD = Modalities([Modality("image", (1, 1280)), Modality("text", (32, 512), sequence=True)])
CREMAD = Modalities([Modality("audio", (600, 80), sequence=True), Modality("video", (6, 1280))])


@pytest.mark.parametrize(
    ("model", "shape", "classes", "preset", "modules", "layer_num", "personal_count"),
    [
        ("cnn", (3, 32, 32), 10, "output", {"7", "9"}, -4, 263_562),
        ("image_text_classifier", CRISISMMD, 8, "input", {"img_proj", "text_rnn"}, 8, 427_008),
        ("har_classifier", KUHAR, 8, "split_input_code", {"acc_conv", "gyro_conv"}, 12, 103_808),
        ("mm_action_classifier", CREMAD, 4, "input", {"audio_conv", "audio_rnn", "video_rnn"}, 14, 704_736),
    ],
)
def test_presets_personalize_the_papers_modules(model, shape, classes, preset, modules, layer_num, personal_count):
    """fedapm.md 2: each strategy's personal part is exactly the spec's modules, and the authors' code's `layer_num`
    tensor count agrees: the first 8/12/14 tensors are personal for the multimodal models, the first 4 (the convs)
    are shared for the CIFAR CNN (a negative count here)."""
    flat = FlatModel(model, shape, classes)
    names, count = _names(model, shape, classes, preset=preset)
    assert {n.split(".")[0] for n in names} == modules
    assert names == (list(flat.spec.names[:layer_num]) if layer_num > 0 else list(flat.spec.names[-layer_num:]))
    assert count == personal_count


def test_split_input_personalizes_the_accelerometer_encoder_only():
    """The paper's KU-HAR split: the accelerometer Conv1d encoder is personal, the gyroscope's (which sees the other
    slice of the input) shared; the code variant (`split_input_code`, checked above) makes both personal."""
    names, count = _names("har_classifier", KUHAR, 8, preset="split_input")
    assert {n.split(".")[0] for n in names} == {"acc_conv"} and count == 103_808 // 2


def test_output_is_the_classifier_for_the_multimodal_models():
    names, _ = _names("image_text_classifier", CRISISMMD, 8)
    assert {n.split(".")[0] for n in names} == {"classifier"}


def test_a_preset_a_model_does_not_define_is_one_line_naming_the_allowed():
    for model, shape, message in [
        (
            "mlp",
            (784,),
            "algorithm.preset='input' is not defined for model 'mlp'; allowed: output, first_layer, last_layer",
        ),
        (
            "har_classifier",
            KUHAR,
            "algorithm.preset='input' is not defined for model 'har_classifier'; allowed: "
            "split_input, split_input_code, output, first_layer, last_layer",
        ),
    ]:
        with pytest.raises(ConfigError) as raised:
            _names(model, shape, 8, preset="input")
        assert str(raised.value) == message


EMPTY = np.arange(0)
SPEC = ParamSpec(("a.weight", "a.bias", "b.weight"), ((2, 2), (2,), (3,)), (0, 4, 6))
"""A hand-made layout: tensor `b` personal, `a` shared."""


def test_fedavg_deviation_is_the_sum_of_per_tensor_norms_over_the_shared_tensors():
    """fedapm.md 1.5, 4.4: sum_k ||u_i[k] - u[k]||_F over the shared tensors (those of the personalized methods'
    split). The shared part moves by a.weight [3, 4, 0, 0] (norm 5) and a.bias [0, 2] (norm 2): 7; the global L2
    norm sqrt(9 + 16 + 4); the personal tensor's change (100) counts in neither. A chunk's rows give one per row."""
    algorithm = FedAvg(FedAvgSettings(personal=("b.*",)), SPEC)
    broadcast = np.arange(9, dtype=np.float32)
    moved = broadcast + np.array([3, 4, 0, 0, 0, 2, 100, 0, 0], np.float32)
    one = ClientInfo(0, 10, 0.5, 2)
    for client, params, expected, l2 in [
        (one, moved, 7.0, math.sqrt(29)),
        (ClientChunk((one, ClientInfo(1, 10, 0.5, 2))), np.stack([moved, broadcast]), [7.0, 0.0], [math.sqrt(29), 0]),
    ]:
        step = algorithm.client_step(client, AveragingClientState(), broadcast)
        next(step)
        with pytest.raises(StopIteration) as done:
            step.send(SGDResult(params, 1.0, 1))
        metrics = done.value.value.metrics
        np.testing.assert_allclose(metrics["deviation"], expected)
        np.testing.assert_allclose(metrics["deviation_l2"], l2)


@pytest.mark.parametrize("training", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_shared_only_fedavg_keeps_the_personal_part_at_init_and_averages_all_m(name, training):
    """The authors' FedAvg/FedProx (fedapm.md 1.5): only the shared part trains, the personal part stays bitwise the
    common initial model, and the server's shared part is the mean over ALL m clients' latest shared parts, the
    stale (here: never selected, still initial) ones included; one client at a time or a stacked chunk alike."""
    algorithm = {"name": name, "lr": 0.1, "batch_size": 32, "epochs": 1, "shared_only": True}
    clients, runtime = {"count": 5, "per_round": 2}, {"num_hosts": 1, "client_training": training}
    sim = InProcess(validate_config(tiny_config(algorithm=algorithm, model=MLP, clients=clients, runtime=runtime)))
    assert sim.host.steps.stacked == (training == "vectorized")
    algorithm, init = sim.host.algorithm, sim.problem.init_params
    personal = ~algorithm.shared
    request = next(algorithm.client_step(ClientInfo(0, 10, 0.2, 5), sim.states[0], sim.coordinator.broadcast()))
    assert np.array_equal(request.mask, algorithm.shared)
    for round_index in range(3):
        sim.round(round_index)
        states = sim.states
        np.testing.assert_array_equal(sim.server.w[personal], init[personal])
        mean = np.mean([states[i].shared.astype(np.float64) for i in range(5)], axis=0)
        np.testing.assert_allclose(sim.server.w[algorithm.shared], mean, atol=1e-6)
        untouched = [i for i in range(5) if np.array_equal(states[i].shared, init[algorithm.shared])]
        if round_index == 0:
            assert len(untouched) == 3  # two selected, three stale at the initial model, all in the mean
    assert np.linalg.norm(sim.server.w - init) > 1e-3


@pytest.mark.parametrize("training", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_shared_start_local_is_the_authors_unimodal_fedavg(name, training):
    """The authors' unimodal FedAvg/FedProx (NieFeiteng/FedAPM `partial_update.py`: `load_remaining_layers` loads
    only the head, which FedAvg never trains): a selected client's shared part starts from its OWN latest one, never
    the server's mean, so FedAvg is local training; FedProx's prox centre is that start (the code's v_i_t, 0.1 hard-
    coded); the personal part stays the initial model; and the PM scored is the client's own model."""
    algorithm = {"name": name, "lr": 0.1, "batch_size": 32, "epochs": 1, "shared_only": True, "shared_start": "local"}
    clients, runtime = {"count": 4, "per_round": 2}, {"num_hosts": 1, "client_training": training}
    sim = InProcess(validate_config(tiny_config(algorithm=algorithm, model=MLP, clients=clients, runtime=runtime)))
    algorithm, init = sim.host.algorithm, sim.problem.init_params
    shared, personal = algorithm.shared, ~algorithm.shared
    sim.round(0, [0, 1])
    sim.round(1, [0, 2])
    states = sim.states
    np.testing.assert_array_equal(states[3].shared, init[shared])  # never selected: untouched
    mean = np.mean([states[i].shared.astype(np.float64) for i in range(4)], axis=0)
    np.testing.assert_allclose(sim.server.w[shared], mean, atol=1e-6)  # the server's mean, which no client loads
    np.testing.assert_array_equal(sim.server.w[personal], init[personal])
    broadcast = sim.coordinator.broadcast()
    assert np.abs(broadcast[shared] - states[1].shared).max() > 1e-3
    request = next(algorithm.client_step(ClientInfo(1, 10, 0.25, 4), states[1], broadcast))
    np.testing.assert_array_equal(request.start[shared], states[1].shared)  # its own model, not the broadcast
    np.testing.assert_array_equal(request.start[personal], init[personal])
    assert np.array_equal(request.mask, shared)
    if name == "fedprox":
        prox = request.term(Prox)
        assert prox.weight == 0.1
        np.testing.assert_array_equal(prox.center, request.start)  # the client's own previous model
    own = algorithm.evaluated_model(states[1], broadcast)
    np.testing.assert_array_equal(own[shared], states[1].shared)
    np.testing.assert_array_equal(own[personal], init[personal])
    # Client 1's second round from its own model equals two rounds of training alone: FedAvg is local training.
    before = states[1].shared.copy()
    sim.round(2, [1, 3])
    assert np.abs(sim.states[1].shared - before).max() > 1e-4
    with pytest.raises(ValueError, match="shared_start='local'.*shared_only=true"):
        FedAvgSettings(shared_start="local")


def test_full_model_fedavg_on_a_one_layer_model_takes_the_deviation_over_the_whole_model():
    """The default preset cannot split MLR (one layer): FedAvg then counts every tensor as shared, while an explicit
    split that leaves a part empty, or shared-only training without a split, is refused."""
    sim = InProcess(validate_config(tiny_config(algorithm={"name": "fedavg", "lr": 0.1})))
    assert sim.host.algorithm.shared.all()
    with pytest.raises(ConfigError, match="algorithm.preset='output' makes every parameter personal"):
        InProcess(validate_config(tiny_config(algorithm={"name": "fedavg", "shared_only": True})))


def test_reset_personal_starts_the_head_from_the_aggregate():
    """The authors' CIFAR code (fedapm.md 2, caveat): at a selected client's round start its personal part is the
    aggregate's (`load_remaining_layers(w, 4)`), and the v-step's proximal anchor with it; without the switch the
    client's own v_i (the paper's persistent v_i). u, pi_i, z_i then cover the whole model."""
    for reset in (True, False):
        algorithm = FedApm(FedApmSettings(personal=("b.*",), reset_personal=reset), SPEC)
        state = algorithm.init_client(ClientInfo(0, 10, 0.5, 2), np.zeros(9, np.float32))
        state.params[6:] = [70, 80, 90]  # a trained v_i, not the aggregate's
        broadcast = np.arange(9 if reset else 6, dtype=np.float32) + 1
        request = next(algorithm.client_step(ClientInfo(0, 10, 0.5, 2), state, broadcast))
        head = broadcast[6:] if reset else state.params[6:]
        prox = request.term(Prox)
        assert prox is not None and np.array_equal(request.start[6:], head) and np.array_equal(prox.center[6:], head)
        assert np.array_equal(request.mask, [False] * 6 + [True] * 3)


def test_fedapm_weight_decay_sits_inside_the_alpha_scaled_gradient():
    """The code's v-step gradient g = (1/m)(grad + mu v) + sigma (v - v_i^t) (fedapm.md 1.5), alpha = 1/m = 1/4,
    mu = 0.01 (the code's; the paper states none, so raysim's default is 0): two full-batch steps of the local
    trainer on FedAPM's v-step request equal two steps of lr * g computed by hand from the model's gradients."""
    model = FlatModel("mlp", (4,), 3)
    generator = np.random.default_rng(3)
    data = ClientData(generator.normal(size=(8, 4)).astype(np.float32), np.arange(8) % 3, np.arange(8), EMPTY, EMPTY)
    lr, alpha, mu, sigma = 0.5, 0.25, 0.01, 0.02
    settings = FedApmSettings(lr=lr, weight_decay=mu, sigma=sigma, epochs=2, batch_size=8)
    algorithm = FedApm(settings, model.spec)
    init = model.initial_parameters(0)
    client = ClientInfo(0, 8, alpha, 4)
    state = algorithm.init_client(client, init)
    request = next(algorithm.client_step(client, state, init[algorithm.shared]))
    trained = LocalTrainer(model).sgd(request, data, np.random.default_rng(0)).params
    v = init.copy()
    for _ in range(2):
        _, grad = model.loss_and_grad(torch.from_numpy(v), torch.from_numpy(data.x), torch.from_numpy(data.y))
        g = alpha * (grad.numpy() + mu * v) + sigma * (v - init)
        v = np.where(algorithm.personal, v - lr * g, v)
    assert np.abs(v - init).max() > 1e-3
    np.testing.assert_allclose(trained, v, rtol=1e-5, atol=1e-7)


def _fedalt(per_round: int = 2, **settings) -> InProcess:
    algorithm = {"name": "fedalt", "lr": 0.1, "batch_size": 32, "epochs": 1, **settings}
    clients = {"count": 5, "per_round": per_round}
    return InProcess(validate_config(tiny_config(algorithm=algorithm, model=MLP, clients=clients)))


def test_fedalt_average_over_all_is_the_mean_of_every_clients_latest_shared_part():
    """average_over: all (the FedAPM authors' server, fedapm.md 1.5): u is the mean over all m = 5 clients of
    their latest shared parts, stale ones and never-selected clients' initial ones included, not the mean of
    the 2 selected; float32 states against the float64 running sum: atol 1e-6."""
    sim = _fedalt(average_over="all")
    shared = sim.host.algorithm.shared
    differs = 0.0
    for round_index in range(3):
        selected = sample_clients(sim.config.seed, round_index, 5, 2)
        sim.round(round_index, selected)
        latest = np.mean([state.params[shared] for state in sim.states.values()], axis=0)
        np.testing.assert_allclose(sim.server.u, latest, atol=1e-6)
        of_selected = np.mean([sim.states[i].params[shared] for i in selected], axis=0)
        differs = max(differs, float(np.abs(sim.server.u - of_selected).max()))
    assert differs > 1e-3  # the stale clients really count


@pytest.mark.parametrize(("alpha", "loss_scale"), [(1.0, "1"), (0.2, "1/m")])
def test_fedalt_average_over_all_is_fedapm_without_dual_under_partial_participation(alpha, loss_scale):
    """FedAPM's server is the mean over all m of the latest z_i; with pi_i = 0, rho -> 0, sigma_i = 0 and u_i <- u
    it is FedAlt with average_over: all, also when only 2 of 5 clients train a round (the default FedAlt differs
    there), and FedAPM's alpha_i = 1/m is FedAlt's loss_scale 1/m (the same steps). The rho = 1e-7 prox term and
    float32 rounding: atol 1e-5."""
    apm = _fedapm(rho=1e-7, sigma=0.0, alpha=alpha, freeze_dual=True, v_anchor="broadcast", u_start="broadcast")
    alt, selected_only = _fedalt(average_over="all", loss_scale=loss_scale), _fedalt(loss_scale=loss_scale)
    for round_index in range(3):
        for sim in (apm, alt, selected_only):
            sim.round(round_index)
    np.testing.assert_allclose(apm.server.u, alt.server.u, atol=1e-5)
    for i, state in alt.states.items():
        np.testing.assert_allclose(apm.states[i].params, state.params, atol=1e-5)
    assert np.abs(selected_only.server.u - alt.server.u).max() > 1e-3


def test_fedalt_average_over_all_needs_uniform_weights():
    with pytest.raises(ConfigError, match="average_over='all' averages uniformly"):
        validate_config(tiny_config(algorithm={"name": "fedalt", "average_over": "all", "aggregation": "samples"}))


@pytest.mark.parametrize("order", ["personal_first", "shared_first"])
def test_fedalt_order_chooses_which_part_trains_first(order):
    """Two phases of E epochs, each moving one part only: personal then shared (Gauss-Seidel), or with
    order: shared_first the received shared part first (the FedAPM authors' unimodal path, where the averaged
    part is the head and the body stays local: `personal` patterns on the body)."""
    sim = _fedalt(order=order, personal=["1.*", "3.*"])
    algorithm = sim.host.algorithm
    client, _split = sim.problem.clients[0]
    data = sim.host.data[client.id]
    masks: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    trainer = LocalTrainer(sim.problem.model_spec.build())

    def execute(request):
        masks.append(request.mask)
        starts.append(request.start)
        return trainer.sgd(request, data, np.random.default_rng(0))

    update = run_client_step(algorithm, client, sim.states[client.id], sim.coordinator.broadcast(), execute)
    first, second = (algorithm.shared, algorithm.personal)
    if order == "personal_first":
        first, second = second, first
    assert [m.tolist() for m in masks] == [first.tolist(), second.tolist()]
    assert algorithm.personal.sum() > algorithm.shared.sum()  # the body (two layers) is personal, the head shared
    moved = update.state.params != starts[0]
    assert moved[first].any() and moved[second].any()


def test_training_loss_in_the_authors_unit_is_the_sum_of_batch_means():
    """tracking.train_loss_unit batch_sum scores the training loss as the FedAPM authors' `inference` does
    (fedapm.md 4.4): per client the sum over batches of loss_sum_batch consecutive training samples of the
    batch-mean loss (here 7 batches of 10 and one of 3); mean stays the mean. float32 sums: rtol 1e-5."""
    source = np.random.default_rng(4)
    x = source.normal(size=(90, 6)).astype(np.float32)
    y = source.integers(0, 3, 90).astype(np.int64)
    data = {0: ClientData(x, y, np.arange(73), np.arange(73, 90), np.array([], np.int64))}
    model = FlatModel("mlp", (6,), 3)
    params = model.initial_parameters(1)
    splits = evaluation_data(data, [0], True, seed=0, evaluation=1)
    mean = ClientScorer(model, 10, "zero").scores(params, splits)[0].train_loss
    summed = ClientScorer(model, 10, "zero", "batch_sum").scores(params, splits)[0].train_loss
    losses = (
        torch.nn.functional.cross_entropy(
            model.forward(torch.from_numpy(params), torch.from_numpy(x[:73])),
            torch.from_numpy(y[:73]),
            reduction="none",
        )
        .detach()
        .numpy()
    )
    assert mean == pytest.approx(losses.mean(), rel=1e-5)
    assert summed == pytest.approx(sum(losses[i : i + 10].mean() for i in range(0, 73, 10)), rel=1e-5)
    assert summed > 7 * mean
    config = validate_config(tiny_config(tracking={"experiment": "tests", "train_loss_unit": "batch_sum"}))
    assert config.tracking.train_loss_unit == "batch_sum"
