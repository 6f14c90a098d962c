"""A dataset of a mixture as the collator sees it (`MixtureSource`).

Stand-in until the mixture branch lands (same fields, as agreed in /work/briefs/interface-notes.md):
the merge takes that branch's file.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MixtureSource:
    """The dataset a batch comes from: every example of the batch carries the same one (key
    `"mixture"`), and the collator hands it on as `batch["dataset"]`.

    `instruction_ids`: the formatted instruction prefix (`data.instructions.instruction_prefix`), tokenized
    without special tokens, empty when the dataset has none; `in_batch_negatives`: false scores each
    query against its own positive and hard negatives only; `query_max_len` / `doc_max_len`: the row
    lengths of queries (view 0) and documents (the other views), special tokens and instruction included."""

    index: int
    name: str
    instruction_ids: tuple[int, ...] = ()
    instruction: str = ""
    in_batch_negatives: bool = True
    query_max_len: int | None = None
    doc_max_len: int | None = None
