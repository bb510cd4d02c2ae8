"""The FLAME authors' switches spec 9 lists (flame.md 9.5, 9.7, 9.16): random local epochs (their --fixed 0), a
zero initial model, deterministic cuDNN kernels, on the real trainers, hosts and coordinator."""

from __future__ import annotations

import dataclasses

from raysim.config import validate_config
from raysim.runtime.problem import prepare
from tests.support.algorithms import FLAME
from tests.support.experiments import tiny_config
from tests.support.kernel_probe import coordinator_flags, kernel_flags


def test_hosts_and_coordinators_set_the_kernel_choice_in_a_ray_actor(ray_local):
    """runtime.deterministic reaches the processes that train: a real host actor, started and then renewed in its
    process with each value (as runtime.reuse_actors renews it), reads back cuDNN deterministic without
    benchmarking (default, the authors' setup_seed), plus torch's deterministic algorithms (all), or benchmarking
    (fast); a coordinator constructed in that Ray worker (torch loaded) sets the same, whatever the flags were."""
    from raysim.runtime.coordinator import CoordinatorSettings
    from raysim.runtime.host import ClientHost
    from raysim.runtime.host_settings import HostSettings

    config = validate_config(tiny_config(algorithm=FLAME))
    assert config.runtime.deterministic == "cudnn"
    problem = prepare(config)
    settings = dataclasses.replace(HostSettings.from_config(config, problem), client_training="sequential")
    want = {"fast": (False, True, False), "all": (True, False, True), "cudnn": (True, False, False)}
    data = (problem.x, problem.y, problem.clients, problem.init_params)
    arguments = (CoordinatorSettings(config.algorithm, problem.params, 4), problem.init_params)
    host = (
        ray_local.remote(ClientHost)
        .options(num_cpus=0)
        .remote(dataclasses.replace(settings, deterministic="fast"), *data)
    )
    got = {}
    for kernels in want:
        if kernels != "fast":  # the defaults: cudnn
            host_settings = settings if kernels == "cudnn" else dataclasses.replace(settings, deterministic=kernels)
            ray_local.get(host.renew.remote(host_settings, *data))
        got[kernels] = ray_local.get(host.__ray_call__.remote(kernel_flags))
        got[kernels, "coordinator"] = ray_local.get(host.__ray_call__.remote(coordinator_flags, arguments, kernels))
    ray_local.kill(host)
    assert got == {**want, **{(kernels, "coordinator"): flags for kernels, flags in want.items()}}
