"""A block of clients' states as rows: one array per state field, one row per client.

A host running a stacking algorithm (Algorithm.stacks) with vectorized training keeps each block of its clients
(ClientHost.blocks) in one table. A client's state is a view of its row; a chunk of the block (its selected
clients) is a view of consecutive rows, or a gathered copy when they are not consecutive; the chunk's new rows
are written back, unless the step wrote them in place (ClientChunk.in_place), which is what a block selected
whole does: its states are then updated where they are, with no copy and no new memory per round. The layout is
that of a [clients, n] tensor, so that the same table could live on a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from raysim.algorithms.base import stack


class StateTable:
    """The states of the clients `clients` (in this order) as rows of one stacked state."""

    def __init__(self, clients: Sequence[int], states: Sequence[Any]):
        """`states`: the clients' states; the table holds copies (never a view of a state it was given, which may
        be read-only or shared, as clients' initial states are)."""
        self.position = {client: row for row, client in enumerate(clients)}
        stacked = stack(list(states))  # new arrays, but for a block of one: views of its state's
        owned = {name: value if value.base is None else np.array(value) for name, value in _arrays(stacked)}
        self.stacked = dataclasses.replace(stacked, **owned)

    def rows(self, clients: Sequence[int]) -> Any:
        """The stacked state of `clients`: views of the table's rows when consecutive, else a copy."""
        chosen = self._selection(clients)
        return dataclasses.replace(self.stacked, **{name: value[chosen] for name, value in _arrays(self.stacked)})

    def store(self, clients: Sequence[int], new: Any, kept: np.ndarray | None = None) -> None:
        """Write the new stacked state of `clients` (rows in this order) into the table, only the rows `kept` (a
        mask; default all), skipping fields whose new rows are the table's own (written in place)."""
        if kept is not None and not kept.all():
            rows = np.flatnonzero(kept)
            clients = [clients[r] for r in rows]
            new = dataclasses.replace(new, **{name: np.asarray(getattr(new, name))[rows] for name, _ in _arrays(new)})
        if not clients:
            return
        chosen = self._selection(clients)
        for name, table in _arrays(self.stacked):
            value = np.asarray(getattr(new, name))
            if isinstance(chosen, slice):
                target = table[chosen]
                if not _same_memory(target, value):
                    target[...] = value
            else:
                table[chosen] = value

    def _selection(self, clients: Sequence[int]) -> slice | list[int]:
        """The rows of `clients`: a slice when they are consecutive (views), else their positions (copies)."""
        positions = [self.position[c] for c in clients]
        start = positions[0]
        if positions == list(range(start, start + len(positions))):
            return slice(start, start + len(positions))
        return positions

    def state(self, client: int) -> Any:
        """The client's state, its vectors views of its rows."""
        row = self.position[client]
        values = {name: value[row] for name, value in _arrays(self.stacked)}
        return dataclasses.replace(
            self.stacked, **{name: value.item() if np.ndim(value) == 0 else value for name, value in values.items()}
        )


def _arrays(stacked: Any) -> list[tuple[str, np.ndarray]]:
    """The stacked state's array fields (fields that are None stay None)."""
    values = [(f.name, getattr(stacked, f.name)) for f in dataclasses.fields(stacked)]
    return [(name, value) for name, value in values if isinstance(value, np.ndarray)]


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are the same elements of the same memory (a step that wrote its rows in place)."""
    return (
        a.shape == b.shape
        and a.strides == b.strides
        and a.dtype == b.dtype
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )
