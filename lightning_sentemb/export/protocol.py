"""What an export reads of a method, as a protocol: exports sit above the methods and never import them
(`methods.SentEmbMethod` provides all of it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

from torch import nn

from ..encoders.plain import Encoder

ExportFormat = Literal["plain", "template", "prefix", "flow"]


class ExportableMethod(Protocol):
    """A trained method as its export sees it.

    `export_format` picks the writer: "plain" (backbone + sentence-transformers' pooling modules),
    "template" (PromptBERT, ConPVP: `TemplateSentenceEncoder`), "prefix" (DCPCSE: `PrefixedTransformer`),
    "flow" (BERT-flow: the plain export plus `FlowHead`, which reads the method's `flow`).
    """

    export_format: ExportFormat
    hparams: Mapping[str, Any]
    encoder: Encoder

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eval_mlp(self) -> nn.Module | None: ...

    @property
    def eval_length(self) -> int: ...

    @property
    def output_size(self) -> int: ...

    def own_hyperparameters(self) -> dict[str, Any]: ...
