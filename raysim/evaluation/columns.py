"""The Arrow columns hosts send the driver: clients' evaluations (one `<model>_<field>` column per score) and
their round records (bytes sent, dropped uploads, the client steps' metrics), one row per client."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from raysim.evaluation.records import ClientEvaluation, ModelScores

SCORE_FIELDS = ("test_acc", "test_loss", "train_loss", "val_acc", "test_f1", "test_auc", "test_loss_sum")
"""ModelScores' fields: a model's scores of a client are the columns `<model>_<field>` of an evaluation table."""

Columns = dict[str, np.ndarray]
"""One model's scores over clients: SCORE_FIELDS -> one value per client (NaN: not scored)."""


def arrow_column(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """A 1-D numpy array of numbers or booleans as an Arrow array, null where `valid` is False. Built from its
    buffers, not with pa.array, which asks pyarrow's pandas shim whether its input is a pandas object and so imports
    pandas into the process: 0.3 s of CPU and 39 MiB in every host, which never uses it."""
    data = np.packbits(values, bitorder="little") if values.dtype == bool else np.ascontiguousarray(values)
    mask = None if valid is None or valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [mask, pa.py_buffer(data)])


def _score_column(values: Sequence[float | None]) -> pa.Array:
    """Scores as a float64 column, null where a value is None (a score not taken)."""
    valid = np.array([value is not None for value in values], bool)
    return arrow_column(np.array([np.nan if value is None else value for value in values], np.float64), valid)


def evaluation_batch(evaluations: Sequence[ClientEvaluation]) -> pa.RecordBatch:
    """Clients' evaluations as columns (what a host sends): `client_id`, then `pm_<field>`, `gm_<field>` and
    `<name>_<field>` for each further model (null for a client without it), by client id."""
    ordered = sorted(evaluations, key=lambda e: e.client_id)
    columns: dict[str, pa.Array] = {"client_id": arrow_column(np.array([e.client_id for e in ordered], np.int64))}
    for kind in ("pm", "gm"):
        for name in SCORE_FIELDS:
            columns[f"{kind}_{name}"] = _score_column([getattr(getattr(e, kind), name) for e in ordered])
    for extra in sorted({name for e in ordered for name in e.extra}):
        for name in SCORE_FIELDS:
            values = [getattr(e.extra[extra], name) if extra in e.extra else None for e in ordered]
            columns[f"{extra}_{name}"] = _score_column(values)
    return pa.RecordBatch.from_pydict(columns)


def evaluation_table(batches: Sequence[pa.RecordBatch]) -> pa.Table:
    """The hosts' evaluation batches as one table, by client id (a further model one host lacks is null there)."""
    table = _joined_batches(batches, evaluation_batch([]))
    return table.take(pa.array(np.argsort(table["client_id"].to_numpy(), kind="stable")))


def client_evaluations(evaluations: pa.Table | pa.RecordBatch) -> list[ClientEvaluation]:
    """The per-client objects of an evaluation table (`evaluation_batch` undone)."""
    rows = evaluations.to_pylist()

    def scores(row: dict, kind: str) -> ModelScores:
        return ModelScores(**{name: row[f"{kind}_{name}"] for name in SCORE_FIELDS})

    extras = extra_model_names(evaluations)
    return [
        ClientEvaluation(
            row["client_id"],
            scores(row, "pm"),
            scores(row, "gm"),
            {name: scores(row, name) for name in extras if row[f"{name}_test_acc"] is not None},
        )
        for row in rows
    ]


def extra_model_names(evaluations: pa.Table | pa.RecordBatch) -> list[str]:
    """The further models (Algorithm.extra_models) an evaluation table has columns of."""
    suffix = "_test_acc"
    names = [c.removesuffix(suffix) for c in evaluations.column_names if c.endswith(suffix)]
    return sorted(name for name in names if name not in ("pm", "gm"))


def model_columns(evaluations: pa.Table | pa.RecordBatch, kind: str) -> Columns:
    """The scores of one model (`pm`, `gm` or a further model's name) of an evaluation table, as float columns."""
    return {
        name: evaluations.column(f"{kind}_{name}").to_numpy(zero_copy_only=False).astype(np.float64)
        for name in SCORE_FIELDS
    }


def score_columns(scores: Sequence[ModelScores]) -> Columns:
    """Per-client ModelScores as columns."""
    return {name: np.array([getattr(s, name) for s in scores], np.float64) for name in SCORE_FIELDS}


RECORD_COLUMNS = ("client_id", "uplink_bytes", "dropped")
"""The columns every round's client records have; the client steps' metrics follow, one column each."""


class ClientRecords:
    """What a host reports of its selected clients' round, built chunk by chunk as columns: client id, bytes
    sent (0 when the upload was dropped), whether the upload was dropped (NaN/inf, runtime.on_nonfinite =
    drop_client), and one column per metric the client steps reported (null where a client reported none)."""

    def __init__(self) -> None:
        self._ids: list[np.ndarray] = []
        self._uplink: list[np.ndarray] = []
        self._dropped: list[np.ndarray] = []
        self._metrics: dict[str, list[tuple[int, np.ndarray]]] = {}
        self._count = 0

    def add(
        self,
        client_ids: Sequence[int],
        uplink_bytes: Sequence[float] | np.ndarray,
        metrics: dict[str, np.ndarray] | None = None,
        dropped: bool = False,
    ) -> None:
        """Records of some clients: their bytes sent and their metrics, one value per client each."""
        count = len(client_ids)
        self._ids.append(np.asarray(client_ids, np.int64))
        self._uplink.append(np.asarray(uplink_bytes, np.float64).reshape(count))
        self._dropped.append(np.full(count, dropped))
        for name, values in (metrics or {}).items():
            column = np.broadcast_to(np.asarray(values, np.float64), (count,))
            self._metrics.setdefault(name, []).append((self._count, column))
        self._count += count

    def batch(self) -> pa.RecordBatch:
        """The records as one Arrow record batch, by client id."""
        columns: dict[str, pa.Array] = {
            "client_id": arrow_column(_joined(self._ids, np.int64)),
            "uplink_bytes": arrow_column(_joined(self._uplink, np.float64)),
            "dropped": arrow_column(_joined(self._dropped, bool)),
        }
        for name in sorted(self._metrics):
            values, reported = np.full(self._count, np.nan), np.zeros(self._count, bool)
            for start, part in self._metrics[name]:
                values[start : start + len(part)] = part
                reported[start : start + len(part)] = True
            columns[name] = arrow_column(values, reported)
        batch = pa.RecordBatch.from_pydict(columns)
        return batch.take(arrow_column(np.argsort(_joined(self._ids, np.int64), kind="stable")))


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def round_records(batches: Sequence[pa.RecordBatch]) -> pa.Table:
    """The hosts' record batches of one round as one table (a metric column one host lacks is null there)."""
    return _joined_batches(batches, ClientRecords().batch())


def _joined_batches(batches: Sequence[pa.RecordBatch], empty: pa.RecordBatch) -> pa.Table:
    """The hosts' batches as one table, a column some batch lacks null there (`empty`: the table of no batch)."""
    tables = [pa.Table.from_batches([batch]) for batch in batches or [empty]]
    return pa.concat_tables(tables, promote_options="default")
