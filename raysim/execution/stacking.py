"""Client states, uploads and requests' results between their one-per-client form and a chunk's stacked form.

A chunk of clients steps as one step over their stacked state (Algorithm.stacks): each vector field becomes the rows
of a [clients, n] array and each number a [clients] array (`stack`); `unstack` gives the rows back as the clients' own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from raysim.algorithms.interface import ClientUpdate
from raysim.algorithms.requests import ClassMeans, FullGradient, LocalSGD


def stack(items: Sequence[Any]) -> Any:
    """Dataclasses of vectors and numbers (client states, uploads, requests' results) as one of the same type whose
    vectors are [len(items), n] arrays and whose numbers are [len(items)] arrays; None fields stay None."""
    first = items[0]
    values = {}
    for f in dataclasses.fields(first):
        column = [getattr(item, f.name) for item in items]
        values[f.name] = None if column[0] is None else _stacked([np.asarray(v) for v in column])
    return dataclasses.replace(first, **values)


def _stacked(vectors: list[np.ndarray]) -> np.ndarray:
    """The vectors as rows of one array: a view of the one vector of a chunk of one, else a stacked copy."""
    return vectors[0][None] if len(vectors) == 1 else np.stack(vectors)


def one_row(item: Any) -> Any:
    """One client's state, upload or update in the stacked form of a chunk of one, without a copy: vectors [1, n]
    views, numbers (and an update's metrics) [1] arrays."""
    if isinstance(item, ClientUpdate):
        metrics = {name: np.atleast_1d(np.asarray(value, np.float64)) for name, value in item.metrics.items()}
        return ClientUpdate(one_row(item.state), one_row(item.upload), metrics)
    return stack([item])


def unstack(stacked: Any, count: int) -> list[Any]:
    """The `count` rows of a stacked dataclass (see `stack`): arrays become views of their row (a state's or
    upload's [clients, C, d] field gives each client its [C, d]), numbers floats or ints; a one-dimensional vector
    field of a request (one vector shared by every row) is shared by every row, and a LocalSGD's terms give each row
    its own (Term.row)."""
    request = isinstance(stacked, LocalSGD | FullGradient | ClassMeans)
    columns = {}
    for f in dataclasses.fields(stacked):
        value = getattr(stacked, f.name)
        if f.name == "terms":
            columns[f.name] = [tuple(term.row(i) for term in value) for i in range(count)]
        elif isinstance(value, np.ndarray) and (value.ndim == 2 or (value.ndim > 2 and not request)):
            columns[f.name] = list(value)
        elif isinstance(value, np.ndarray) and value.ndim == 1 and not request:
            columns[f.name] = value.tolist()
        else:
            columns[f.name] = [value] * count
    kind = type(stacked)
    return [kind(**{name: column[i] for name, column in columns.items()}) for i in range(count)]


def unstack_update(update: ClientUpdate, count: int) -> list[ClientUpdate]:
    """The clients' own updates from a stacked one (`run_stacked_step`): vectors are views of their row, metrics
    floats."""
    metrics = {name: np.asarray(values) for name, values in update.metrics.items()}
    return [
        ClientUpdate(state, upload, {name: float(values[i]) for name, values in metrics.items()})
        for i, (state, upload) in enumerate(
            zip(unstack(update.state, count), unstack(update.upload, count), strict=True)
        )
    ]


def own_arrays(state: Any) -> Any:
    """A client state whose vectors are copies (a row view would keep the whole chunk's array alive)."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    copies = {name: np.array(value) for name, value in fields.items() if isinstance(value, np.ndarray)}
    return dataclasses.replace(state, **copies)
