"""Training corpora as `.jsonl` or `.parquet` files with named fields, mapped to the training columns
(`data.datasets.<name>.columns: {sent0: query, sent1: pos, hard_neg: neg}`), and the token limits of a
corpus's query and document columns.

A field holding a list (BGE's and E5's `pos` / `neg` lists): for `hard_neg`, its first k entries become
`hard_neg_1..k` (k: the first row's count; every row needs k), for another column its first entry.
Without `columns`, the file's own fields named as ours (`sent0`, `sent1`, `hard_neg`, `hard_neg_k`) are read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow.parquet as pq

from ..errors import SentEmbUserError

TABLE_SUFFIXES = (".jsonl", ".parquet")
TRAINING_FIELDS = ("sent0", "sent1", "hard_neg")


class SideLimits(NamedTuple):
    """Token limits of the query column (`sent0`) and of the document columns (the others)."""

    query: int
    document: int


def token_limit(max_tokens: int | SideLimits, column: str) -> int:
    if isinstance(max_tokens, SideLimits):
        return max_tokens.query if column == "sent0" else max_tokens.document
    return max_tokens


def table_parts(path: Path, columns: Mapping[str, str], rows: int) -> Iterator[tuple[dict[str, list], int]]:
    """The file's examples in blocks of at most `rows`: ({column: [text]}, bytes read)."""
    records = _parquet_records(path, rows) if path.suffix == ".parquet" else _jsonl_records(path, rows)
    mapping, negatives, first_row = dict(columns), None, 1
    for block, size in records:
        if not mapping:
            mapping = {name: name for name in block[0] if name in TRAINING_FIELDS or name.startswith("hard_neg_")}
            if "sent0" not in mapping:
                raise SentEmbUserError(f"{path}: no field sent0 in the first row ({', '.join(block[0])}); map the "
                                       "file's fields with `columns: {sent0: FIELD, sent1: FIELD, hard_neg: FIELD}`")
        part: dict[str, list] = {}
        for ours, theirs in mapping.items():
            values = [_field(record, theirs, path, first_row + i, ours) for i, record in enumerate(block)]
            if ours == "hard_neg" and isinstance(values[0], list):
                negatives = negatives or len(values[0])
                short = next((i for i, v in enumerate(values) if len(v) < negatives), None)
                if short is not None:
                    raise SentEmbUserError(f"{path}: row {first_row + short} has {len(values[short])} hard negative(s) "
                                           f"in {theirs!r}, the first row {negatives}; give every row as many")
                part.update({f"hard_neg_{k + 1}": [v[k] for v in values] for k in range(negatives)})
            else:
                part[ours] = [v[0] if isinstance(v, list) else v for v in values]
        first_row += len(block)
        yield part, size


def _field(record: dict[str, Any], name: str, path: Path, row: int, ours: str) -> Any:
    value = record.get(name)
    if value is None or value == []:
        raise SentEmbUserError(f"{path}: row {row} has no field {name!r} (read as {ours}); it has "
                               f"{', '.join(record)}: fix the row or `columns`")
    return value


def _jsonl_records(path: Path, rows: int) -> Iterator[tuple[list[dict[str, Any]], int]]:
    with open(path, "rb") as file:
        line_number = 0
        while lines := list(islice(file, rows)):
            block = []
            for line in lines:
                line_number += 1
                if line.strip():
                    try:
                        block.append(json.loads(line))
                    except ValueError as error:
                        raise SentEmbUserError(f"{path}: line {line_number} is not JSON ({error})") from None
            if block:
                yield block, sum(map(len, lines))


def _parquet_records(path: Path, rows: int) -> Iterator[tuple[list[dict[str, Any]], int]]:
    table = pq.ParquetFile(path)
    size, total = path.stat().st_size, max(table.metadata.num_rows, 1)
    for batch in table.iter_batches(batch_size=rows):
        yield batch.to_pylist(), size * batch.num_rows // total
