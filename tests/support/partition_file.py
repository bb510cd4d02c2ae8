"""What the partition_file tests of several tiers share."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _write(path: Path, columns: dict, metadata: dict | None = None) -> Path:
    table = pa.table(columns)
    if metadata is not None:
        table = table.replace_schema_metadata({b"raysim": json.dumps(metadata).encode()})
    pq.write_table(table, path)
    return path
