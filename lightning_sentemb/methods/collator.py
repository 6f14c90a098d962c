"""The training batch builder a method hands to its DataLoader.

A `spawn` or `forkserver` worker start (forkserver is Python 3.14's default on Linux) pickles the
DataLoader's `collate_fn` into every worker. A method's bound `collate` would carry the whole
LightningModule, backbone weights included, into each of them; a `Collator` holds only what
building a batch reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict

from ..data.mixture import MixtureSource
from ..encoders.instruction import instructed_features
from ..encoders.plain import PlainFormat
from ..errors import SentEmbUserError
from ..losses.mlm import PredictedTokens, mask_tokens
from .guide import guide_reads_text, guide_settings


class Collator:
    """Training batches from tokenized examples, built in the DataLoader's workers.

    Holds the encoder's input format (tokenizer, templates), the longest row it takes, the method's
    hyper-parameters and `generator`, the source of every random draw (MLM masks, sampled templates),
    which the training loader reseeds for each batch (`data.loader.SeededCollate`) so the draws
    repeat after a resume whatever the number of workers. A method's subclass contributes its views
    (`__call__`).
    """

    def __init__(self, format: PlainFormat, max_length: int, hparams: AttributeDict) -> None:
        self.format = format
        self.max_length = max_length
        self.hparams = hparams
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        """The batch: `features` (the rows of every view, view after view), `num_views`, and what the
        method's loss reads."""
        raise NotImplementedError

    # the corpus columns every training example must have (`check_columns`), and which corpus provides them
    required_columns: tuple[str, ...] = ("sent0",)
    corpus_hint = ("one sentence a line (.txt), or a csv with sent0 (and sent1[,hard_neg] for supervised NLI "
                   "triplets)")

    def check_columns(self, columns: list[str], source: str) -> None:
        """One line before training when the tokenized corpus lacks a column this method's views read."""
        missing = [column for column in self.required_columns if column not in columns]
        if missing:
            raise SentEmbUserError(f"{source}: the corpus has no column {', '.join(missing)} (it has "
                                   f"{', '.join(columns)}); this method trains on {self.corpus_hint}")

    def __getstate__(self) -> dict[str, Any]:
        """The generator's state as bytes: a `torch.Generator` (torch 2.13) pickles its state as a
        temporary tensor, which a spawned worker then fails to map from shared memory."""
        return {**self.__dict__, "generator": self.generator.get_state().numpy().tobytes()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.generator = torch.Generator()
        self.generator.set_state(torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8))

    def view_features(self, views: list[list[list[int]]], source: MixtureSource | None) -> dict[str, Any]:
        """Padded features of the views' rows, view after view. From a mixture's dataset (`source`), its
        instruction goes before view 0's rows (the queries, `encoders.instruction`), not the others (the
        documents), and each side is cut at its own length (the model's maximum when unset)."""
        if source is None:
            return self.format.build([row for view in views for row in view], max_length=None)
        documents = [row for view in views[1:] for row in view]
        return instructed_features(self.format, views[0], documents, source.instruction_ids,
                                   self.hparams.pool_instruction, source.query_max_len or self.max_length,
                                   source.doc_max_len or self.max_length,
                                   option=f"data.datasets.{source.name}.query_max_len")

    def add_mlm_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Attach corrupted copies of the training rows for the MLM auxiliary loss, when enabled."""
        if self.hparams.mlm_weight > 0:
            features = batch["features"]
            ids, labels = mask_tokens(
                features["input_ids"], features["attention_mask"], self.format.tokenizer,
                self.hparams.mlm_probability, self.generator,
            )
            batch["mlm"] = {"input_ids": ids, "attention_mask": features["attention_mask"],
                            "layout": features["layout"],  # for a prefix's packed MLM forward
                            "predicted": PredictedTokens.from_labels(labels)}
        return batch

    def add_guide_texts(self, batch: dict[str, Any], rows: list[list[int]],
                        templates: Sequence[int] | None = None) -> dict[str, Any]:
        """What a guide reads of the sentence rows (`methods.guide`): each row's text, decoded from its ids,
        when a guide model reads them (it tokenizes them its own way); with `drop_duplicates`, `row_keys`,
        one int64 a row, equal for rows of equal ids under the same template (`templates[i]`, row i's
        template, where a format has several). Python's hash of a tuple of ints is the same in every
        process, so keys compare across DDP ranks."""
        settings = guide_settings(self.hparams.get("guide"))
        if guide_reads_text(self.hparams.get("guide")):
            batch["texts"] = self.format.tokenizer.batch_decode(rows, skip_special_tokens=True)
        if settings is not None and settings["drop_duplicates"]:
            templates = templates if templates is not None else [0] * len(rows)
            keys = [hash((template, *row)) for template, row in zip(templates, rows, strict=True)]
            batch["row_keys"] = torch.tensor(keys, dtype=torch.int64)
        return batch
