"""A mixture of training datasets (`data.datasets`), each read through the corpus layer, one dataset a batch.

`data.datasets` maps a name to a dataset:

    data:
      datasets:
        nli: {path: corpora/nli_for_simcse.csv, format: triplets, instruction: "Retrieve ...", weight: 1}
        msmarco: {path: msmarco.jsonl, format: pairs, columns: {sent0: query, sent1: pos}, in_batch_negatives: false}

Keys: `path` (a relative path is under `data.data_dir`; `senteval:...` names a corpus derived from the
SentEval mirror, `data.senteval_corpora`), `format` (`FORMATS`: the columns training reads), `columns`
(the file's column of each of ours, for `.jsonl` and `.parquet`), `weight`, `instruction` (prepended to
the queries by the instruction-aware collators), `in_batch_negatives`, `query_max_len` / `doc_max_len`
(tokens of the query column `sent0` / of the others, special tokens included; default `data.max_seq_len`).
Each dataset is tokenized once per node into its own memory-mapped cache (`data.corpus`); nothing of it
is held in memory. `data.train_file` alone is a mixture of one, read as it always was (no `"mixture"` key).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from datasets import Dataset as ArrowDataset
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from ..errors import SentEmbUserError
from .corpus import NUMBERED_HARD_NEGATIVE
from .instructions import E5_FORMAT, instruction_prefix
from .table_files import TABLE_SUFFIXES, SideLimits

# the columns each format trains on (hard negatives: `hard_neg` or `hard_neg_1..k`, `corpus.nli_columns`)
FORMATS = {"sentences": ("sent0",), "pairs": ("sent0", "sent1"), "triplets": ("sent0", "sent1", "hard_neg"),
           "nli": ("sent0", "sent1", "hard_neg")}
KEYS = ("path", "format", "columns", "weight", "instruction", "in_batch_negatives", "query_max_len", "doc_max_len")


class MixtureSource(NamedTuple):
    """The dataset a training example (key `"mixture"`) and its batch (`batch["dataset"]`) come from:
    host-side values, read by the collators (instruction, lengths) and the loss (in-batch negatives)
    and logged by name, never a device read. Immutable; a named tuple, not a frozen dataclass, because
    Lightning's move of the batch to the device rebuilds every dataclass in it, which a frozen one refuses
    (a named tuple it rebuilds field by field, unchanged)."""

    index: int
    name: str
    instruction: str = ""
    instruction_ids: tuple[int, ...] = ()  # the instruction's token ids, no special tokens
    in_batch_negatives: bool = True
    query_max_len: int | None = None
    doc_max_len: int | None = None


@dataclass(frozen=True)
class DatasetSpec:
    """One entry of `data.datasets`, checked (`parse_datasets`)."""

    name: str
    path: str
    format: str | None = None
    columns: Mapping[str, str] = field(default_factory=dict)
    weight: float = 1.0
    instruction: str = ""
    in_batch_negatives: bool = True
    query_max_len: int | None = None
    doc_max_len: int | None = None

    def source(self, index: int, tokenizer: PreTrainedTokenizerBase,
               instruction_format: str = E5_FORMAT) -> MixtureSource:
        """The dataset as its batches carry it: the instruction written in `instruction_format`, tokenized."""
        prefix = instruction_prefix(self.instruction, instruction_format, "data.instruction_format")
        ids = tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
        return MixtureSource(index, self.name, self.instruction, tuple(ids), self.in_batch_negatives,
                             self.query_max_len, self.doc_max_len)

    def limits(self, max_seq_len: int, specials: int) -> int | SideLimits:
        """Token limits of the cached columns: the lengths less the special tokens (one int when equal, so a
        dataset without its own lengths shares `data.train_file`'s cache)."""
        query, doc = ((length or max_seq_len) - specials for length in (self.query_max_len, self.doc_max_len))
        for option, tokens in (("query_max_len", query), ("doc_max_len", doc)):
            if tokens < 1:
                raise SentEmbUserError(f"data.datasets.{self.name}.{option} leaves no token after the {specials} "
                                       f"special token(s); set it to {specials + 1} or more")
        return query if query == doc else SideLimits(query, doc)

    def check_columns(self, columns: Sequence[str], path: str) -> None:
        """One line when the tokenized dataset does not have its format's columns."""
        if self.format is None:
            return
        wanted = FORMATS[self.format]
        negatives = [c for c in columns if c == "hard_neg" or NUMBERED_HARD_NEGATIVE.fullmatch(c)]
        have = [c for c in columns if c in ("sent0", "sent1")] + (["hard_neg"] if negatives else [])
        if have != list(wanted):
            missing = [c for c in wanted if c not in have]
            problem = (f"has no column {', '.join(missing)}" if missing else
                       f"has columns beyond the format ({', '.join(c for c in have if c not in wanted)})")
            raise SentEmbUserError(f"data.datasets.{self.name} ({path}): format {self.format} reads "
                                   f"{', '.join(wanted)}, but the dataset {problem}; it has {', '.join(columns)} "
                                   "(map a jsonl/parquet file's columns with `columns: {sent0: ..., sent1: ...}`)")


def parse_datasets(datasets: Mapping[str, Any]) -> list[DatasetSpec]:
    """`data.datasets` checked, in its order: one line naming the dataset and key for what is wrong."""
    if not isinstance(datasets, Mapping) or not datasets:
        raise SentEmbUserError("data.datasets needs at least one dataset: {name: {path: ..., format: ...}}")
    return [_parse_one(str(name), entry) for name, entry in datasets.items()]


def _parse_one(name: str, entry: Any) -> DatasetSpec:
    where = f"data.datasets.{name}"
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, Mapping) or "path" not in entry:
        raise SentEmbUserError(f"{where} needs a path: {{path: FILE, format: {' | '.join(FORMATS)}}}")
    unknown = [key for key in entry if key not in KEYS]
    if unknown:
        raise SentEmbUserError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; "
                               f"the keys are {', '.join(KEYS)}")
    spec = DatasetSpec(name=name, **{key: value for key, value in entry.items() if value is not None})
    if spec.format is not None and spec.format not in FORMATS:
        raise SentEmbUserError(f"{where}.format is {spec.format!r}; use one of {', '.join(FORMATS)} (the file's "
                               "type, .txt, .csv, .jsonl or .parquet, comes from its name)")
    weight = spec.weight
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise SentEmbUserError(f"{where}.weight is {weight!r}; a weight is a positive number (1: by size)")
    if not isinstance(spec.columns, Mapping) or any(not isinstance(v, str) for v in spec.columns.values()):
        raise SentEmbUserError(f"{where}.columns maps our columns to the file's: {{sent0: query, sent1: pos}}")
    if spec.columns and not spec.path.endswith(TABLE_SUFFIXES):
        raise SentEmbUserError(f"{where}.columns maps the fields of a .jsonl or .parquet file; {spec.path} is read "
                               "by its header (csv) or as one sentence a line (txt): drop columns")
    for option in ("query_max_len", "doc_max_len"):
        value = getattr(spec, option)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SentEmbUserError(f"{where}.{option} is {value!r}; a length is a number of tokens")
    return spec


class MixtureDataset(Dataset):
    """The datasets as one: item (d, i) is row i of dataset d, tokenized as today, plus `"mixture"`, its
    `MixtureSource` (`MixtureBatchSampler` yields the keys)."""

    def __init__(self, datasets: Sequence[ArrowDataset], sources: Sequence[MixtureSource]) -> None:
        self.datasets = list(datasets)
        self.sources = list(sources)

    def __len__(self) -> int:
        return sum(map(len, self.datasets))

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        d, i = key
        return {**self.datasets[d][i], "mixture": self.sources[d]}

    @property
    def sizes(self) -> list[int]:
        return [len(dataset) for dataset in self.datasets]
