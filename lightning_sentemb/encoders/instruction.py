"""Queries with an instruction before them, pooled over their text only.

A query row is `prefix specials + instruction + text + suffix specials`; documents are rows as always.
The instruction is kept whole and the text cut so the row fits its length. With the instruction left
out of the pooled vector (`pool_instruction: false`, LLM2Vec's and NV-Embed's choice), the row's
`pool_mask` is its attention mask with the positions before the text set to 0: the prefix special
tokens and the instruction, exactly what sentence-transformers' `Pooling(include_prompt=False)` leaves
out (its prompt length counts the prompt's tokens with the tokenizer's leading special tokens), so an
export pools as training did. The mean poolers read `pool_mask` (`encoders.plain.pool`) on the padded
and the padding-free forward alike (both hand the pooler padded states); `cls` and `last` read one
token, the [CLS] in front or the text's last, so the instruction reaches them through attention only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import SentEmbUserError
from .plain import PlainFormat, pad_rows


def query_row(format: PlainFormat, ids: Sequence[int], instruction_ids: Sequence[int], max_length: int | None,
              option: str = "query_max_len") -> list[int]:
    """One query row: specials around the instruction then the text, the text cut so the row fits
    `max_length` (None: no cut); a length that leaves the text no token is one line naming `option`."""
    if max_length is not None:
        room = max_length - format.num_special_tokens - len(instruction_ids)
        if room < 1:
            raise SentEmbUserError(f"{option} {max_length}: leaves no token for the text after the "
                                   f"{format.num_special_tokens} special token(s) and the instruction's "
                                   f"{len(instruction_ids)}; raise it")
        ids = ids[:room]
    return format.prefix_ids + list(instruction_ids) + list(ids) + format.suffix_ids


def instructed_features(format: PlainFormat, queries: list[list[int]], documents: list[list[int]],
                        instruction_ids: Sequence[int], pool_instruction: bool, query_max_len: int | None = None,
                        doc_max_len: int | None = None, option: str = "query_max_len") -> dict[str, Any]:
    """Padded features of the query rows (with the instruction) then the document rows (without), and,
    when the instruction is left out of pooling, their `pool_mask`."""
    rows = [query_row(format, ids, instruction_ids, query_max_len, option) for ids in queries]
    rows += [format.wrap(ids, doc_max_len) for ids in documents]
    features = pad_rows(rows, format.pad_id)
    if instruction_ids and not pool_instruction:
        mask = features["attention_mask"].clone()
        mask[: len(queries), : len(format.prefix_ids) + len(instruction_ids)] = 0
        features["pool_mask"] = mask
    return features
