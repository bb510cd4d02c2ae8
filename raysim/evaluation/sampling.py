"""Which clients an evaluation scores (tracking.eval_sample): all of them, or a seeded sample, as a cross-device
paper reports its accuracy over a sample of its clients rather than every one of 100,000 (issue 49.3)."""

from __future__ import annotations

import numpy as np

from raysim.seeding import Stream, rng


def evaluation_sample(seed: int, num_clients: int, size: int | None) -> np.ndarray | None:
    """The sorted ids of the `size` clients every evaluation of a run scores, drawn without replacement from the
    run's seed alone (so the same on any number of hosts, in any process, at every evaluation); None when `size`
    is None or covers every client: every client is scored."""
    if size is None or size >= num_clients:
        return None
    return np.sort(rng(seed, Stream.EVALUATION, num_clients).choice(num_clients, size=size, replace=False))
