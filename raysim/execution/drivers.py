"""Drivers of the client-step generators: run a step's requests through an executor and return its update.

`run_client_step` drives one client's step with any executor; `run_client_steps` drives several clients' steps in
lockstep, handing an executor every pending request of a turn together; `run_stacked_step` runs several clients as
one step over their stacked state (Algorithm.stacks). Plain Python over the algorithm interface: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import numpy as np

from raysim.algorithms.interface import Algorithm, ClientChunk, ClientInfo, ClientUpdate
from raysim.algorithms.requests import Request, Result


def run_stacked_step(
    algorithm: Algorithm,
    clients: Sequence[ClientInfo],
    state: Any,
    broadcast: Any,
    execute: Callable[[Request], Result],
    in_place: bool = False,
) -> ClientUpdate:
    """The client steps of several clients as ONE step over their stacked state (`Algorithm.stacks`; `stack` makes
    one from the clients' states, rows in the order of `clients`): every request it yields is a stacked one that
    `execute` runs for all rows at once, returning a stacked result. `in_place`: the step may write into the
    stacked state's arrays (ClientChunk.in_place). Returns the stacked update: state and upload with [k, ...]
    fields, metrics as float64 arrays [k]; `unstack_update` splits it into the clients' own."""
    chunk = ClientChunk(tuple(clients), in_place)
    step = algorithm.client_step(chunk, state, broadcast)  # type: ignore[arg-type]  # a stacking step takes chunks
    update = drive(step, execute)
    count = len(clients)
    update.metrics = {
        name: np.broadcast_to(np.asarray(value, np.float64), (count,)) for name, value in update.metrics.items()
    }
    return update


RequestT = TypeVar("RequestT")
ResultT = TypeVar("ResultT")
ReturnT = TypeVar("ReturnT")


def drive(step: Generator[RequestT, ResultT, ReturnT], execute: Callable[[RequestT], ResultT]) -> ReturnT:
    """Run a generator of requests (a client step, an adaptation) to completion; returns its value."""
    try:
        request = next(step)
        while True:
            request = step.send(execute(request))
    except StopIteration as finished:
        return finished.value


def run_client_step(
    algorithm: Algorithm,
    client: ClientInfo,
    state: Any,
    broadcast: Any,
    execute: Callable[[Any], Any],
) -> ClientUpdate:
    """Drive a client step to completion, executing each yielded request with `execute`."""
    return _with_float_metrics(drive(algorithm.client_step(client, state, broadcast), execute))


def _with_float_metrics(update: ClientUpdate) -> ClientUpdate:
    """The update with its metrics as Python floats (a step may compute them as numpy numbers, or as the one row
    of a kernel over rows)."""
    update.metrics = {name: float(np.asarray(value).reshape(-1)[0]) for name, value in update.metrics.items()}
    return update


def run_client_steps(
    algorithm: Algorithm,
    clients: Sequence[ClientInfo],
    states: Sequence[Any],
    broadcast: Any,
    execute_many: Callable[[list[tuple[int, Request]]], Sequence[Result]],
) -> list[ClientUpdate]:
    """Drive the client steps of several clients together, so that an executor can run their requests at once.

    Every turn, the pending request of each unfinished client goes to `execute_many` in one list of
    (client id, request), in the order of `clients`; it returns their results in the same order, and each
    result is sent back to its client's step. A client's own requests come and go in the order that
    `run_client_step` gives them, so an executor that keys its randomness by client and request number
    gives the same results either way. Returns the updates in the order of `clients`.
    """
    steps = [algorithm.client_step(c, s, broadcast) for c, s in zip(clients, states, strict=True)]
    updates: dict[int, ClientUpdate] = {}
    pending: dict[int, Request] = {}

    def advance(position: int, result: Result | None) -> None:
        """Send a result (None: start) to a client's step; keep its next request, or its update when it ends."""
        step = steps[position]
        try:
            pending[position] = next(step) if result is None else step.send(result)
        except StopIteration as finished:
            updates[position] = _with_float_metrics(finished.value)

    for position in range(len(steps)):
        advance(position, None)
    while pending:
        turn = sorted(pending)
        results = execute_many([(clients[p].id, pending.pop(p)) for p in turn])
        if len(results) != len(turn):
            raise ValueError(f"run_client_steps: {len(turn)} requests but {len(results)} results")
        for position, result in zip(turn, results, strict=True):
            advance(position, result)
    return [updates[position] for position in range(len(steps))]
