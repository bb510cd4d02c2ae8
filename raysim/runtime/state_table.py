"""A block of clients' states as rows: one array per state field, one row per client.

A host running a stacking algorithm (Algorithm.stacks) with vectorized training keeps each block of its clients
(ClientSteps.blocks) in one table. A client's state is a view of its row; a chunk of the block (its selected
clients) is a view of consecutive rows, or a gathered copy when they are not consecutive; the chunk's new rows
are written back, unless the step wrote them in place (ClientChunk.in_place), which is what a block selected
whole does: its states are then updated where they are, with no copy and no new memory per round. The layout is
that of a [clients, n] tensor, so that the same table could live on a GPU.

`StateTables` is a host's client states without a memory budget: a mapping client id -> state whose blocks become
StateTables when they are first stepped. It and ClientStateStore (past a budget) are the two ClientStates
(raysim.runtime.steps): one client's state by id, a chunk's states as rows, its new rows stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import numpy as np

from raysim.execution.stacking import stack
from raysim.runtime.state_store import StoreStats


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
            clients = [clients[r] for r in rows.tolist()]
            new = dataclasses.replace(new, **{name: np.asarray(getattr(new, name))[rows] for name, _ in _arrays(new)})
        if not clients:
            return
        chosen = self._selection(clients)
        for name, table in _arrays(self.stacked):
            value = np.asarray(getattr(new, name))
            if isinstance(chosen, slice):
                target = table[chosen]
                if not same_memory(target, value):
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


class StateTables(MutableMapping[int, Any]):
    """Client id -> state of a host's clients held in memory, kept by fixed blocks (ClientSteps.blocks): a block's
    first `rows` makes its states one StateTable, whose row views are then its clients' states, stepped where they
    are. Setting one client's state (a restore) lets go of its block's table, made again at the block's next step."""

    def __init__(self, blocks: Sequence[Sequence[int]]):
        self.blocks = [list(block) for block in blocks]
        self.block = {client: index for index, block in enumerate(self.blocks) for client in block}
        self._states: dict[int, Any] = {}
        self._tables: dict[int, StateTable] = {}
        """Each stepped block's states, by its index in `blocks`."""

    def __getitem__(self, client: int) -> Any:
        return self._states[client]

    def __setitem__(self, client: int, state: Any) -> None:
        self._states[client] = state
        self._tables.pop(self.block[client], None)

    def __delitem__(self, client: int) -> None:
        del self._states[client]
        self._tables.pop(self.block[client], None)

    def __iter__(self) -> Iterator[int]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def rows(self, clients: Sequence[int]) -> Any:
        """The stacked state of `clients`, selected clients of one block: views of its table's rows when
        consecutive, else a copy."""
        index = self.block[clients[0]]
        table = self._tables.get(index)
        if table is None:  # the block's first step (or the first after a restore): its states become one table
            members = self.blocks[index]
            table = self._tables[index] = StateTable(members, [self._states[c] for c in members])
            self._states.update({c: table.state(c) for c in members})
        return table.rows(clients)

    def store(self, clients: Sequence[int], new: Any, kept: np.ndarray | None = None) -> None:
        """Write the new stacked state of `clients` (as `rows` gave it) into their block's table, only the rows
        `kept` (default all)."""
        table = self._tables[self.block[clients[0]]]
        table.store(clients, new, kept)
        self._states.update({c: table.state(c) for c in clients})

    def stats(self) -> StoreStats | None:
        """None: nothing spills (ClientStateStore.stats)."""
        return None

    def close(self) -> None:
        """Forget every state."""
        self._states.clear()
        self._tables.clear()


def _arrays(stacked: Any) -> list[tuple[str, np.ndarray]]:
    """The stacked state's array fields (fields that are None stay None)."""
    values = [(f.name, getattr(stacked, f.name)) for f in dataclasses.fields(stacked)]
    return [(name, value) for name, value in values if isinstance(value, np.ndarray)]


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are the same elements of the same memory (a step that wrote its rows in place)."""
    return (
        a.shape == b.shape
        and a.strides == b.strides
        and a.dtype == b.dtype
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )
