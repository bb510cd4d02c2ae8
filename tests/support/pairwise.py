"""A pairwise (all-pairs) cover: few rows in which every two values of two different axes meet at least once.

In-parameter-order growth (Lei and Tai's IPO): the rows start as every allowed combination of the two largest
axes; each further axis is added to the rows one at a time, each row taking the value that meets the most pairs
not met yet (horizontal growth), and the pairs still unmet get rows of their own (vertical growth). `allowed`
judges partial rows (axes missing from the row are unknown), so that no row is a combination refused on purpose;
a pair that no allowed row can hold is left out. Deterministic: same axes, same rows."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from itertools import combinations, product

Row = dict[str, Hashable]
Pair = tuple[tuple[str, Hashable], tuple[str, Hashable]]


def pairs_of(row: Mapping[str, Hashable], among: Sequence[str]) -> set[Pair]:
    """The pairs of values a row holds, between the axes `among` that it has a value for."""
    known = [(axis, row[axis]) for axis in among if axis in row]
    return set(combinations(known, 2))


def pairwise(axes: Mapping[str, Sequence[Hashable]], allowed: Callable[[Row], bool] = lambda row: True) -> list[Row]:
    """Rows (one value per axis) in which every allowed pair of values of two axes meets at least once."""
    order = sorted(axes, key=lambda axis: -len(axes[axis]))
    if len(order) < 2:
        return [{order[0]: value} for value in axes[order[0]]] if order else []
    first, second = order[:2]
    rows: list[Row] = [row for a, b in product(axes[first], axes[second]) if allowed(row := {first: a, second: b})]
    for position in range(2, len(order)):
        axis, done = order[position], order[: position + 1]
        unmet = {
            ((earlier, a), (axis, b))
            for earlier in order[:position]
            for a in axes[earlier]
            for b in axes[axis]
            if allowed({earlier: a, axis: b})
        }
        for row in rows:  # horizontal growth
            choices = [value for value in axes[axis] if allowed({**row, axis: value})]
            if not choices:
                continue
            best = max(choices, key=lambda value: len(pairs_of({**row, axis: value}, done) & unmet))
            row[axis] = best
            unmet -= pairs_of(row, done)
        for (earlier, a), (_, b) in sorted(unmet, key=repr):  # vertical growth
            if ((earlier, a), (axis, b)) not in unmet:
                continue
            host = next(
                (
                    row
                    for row in rows
                    if row.get(axis, b) == b and row.get(earlier, a) == a and allowed({**row, earlier: a, axis: b})
                ),
                None,
            )
            if host is None:
                host = {}
                rows.append(host)
            host.update({earlier: a, axis: b})
            unmet -= pairs_of(host, done)
    for row in rows:  # values no pair asked for: the first allowed one
        for axis in order:
            if axis not in row:
                row[axis] = next(value for value in axes[axis] if allowed({**row, axis: value}))
    return rows
