"""Echo embeddings (Springer et al., ICLR 2025, "Repetition Improves Language Model Embeddings"): a causal
model reads the sentence twice and is pooled over the second copy only, whose every token has seen the
whole sentence in the first.

The template is text with `[X]` twice (default `ECHO_TEMPLATE`, the paper's wording). As in
`encoders.template`, the text around the copies is tokenized piece by piece and the sentence's cached ids
are put in between, so the second copy's span is known from the ids themselves: its first position is the
length of what precedes it. Searching the tokenized string would miss it wherever the tokenizer merges
text across a copy's edge (byte-level BPE merging `: x` into one token). With byte-level BPE, the
sentence's first word is tokenized as a text's first word (no leading space), as in PromptEOL's template.

Rows carry `echo_mask` (batch, width): 1 on the second copy's tokens, which `echo_mean` averages and whose
last token `echo_last` reads (`encoders.plain.pool`).
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from ..errors import SentEmbUserError
from .plain import ECHO_POOLERS, Encoder, PlainFormat, pad_ids, pad_rows

ECHO_TEMPLATE = "Rewrite the sentence: [X], rewritten sentence: [X]"


def echo_template(template: str) -> str:
    """The template a `template` setting names: "echo" is the paper's wording, else the text itself."""
    return ECHO_TEMPLATE if template == "echo" else template


class EchoFormat(PlainFormat):
    """The sentence twice inside an echo template (the tokenizer's special tokens around the whole row),
    with `echo_mask` over the second copy. `num_special_tokens` is 0: `max_seq_len` is the sentence's own
    budget, the template comes on top (as `TemplateFormat`); at evaluation each copy is cut so the row fits."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str) -> None:
        super().__init__(tokenizer)
        self.template = echo_template(template)
        pieces = self.template.split("[X]")
        if len(pieces) != 3:
            raise SentEmbUserError(f"model.init_args.template {template!r}: an echo template holds [X] exactly twice "
                                   f"(e.g. {ECHO_TEMPLATE!r})")
        before, between, after = (self.piece_ids(piece) for piece in pieces)
        self.before = self.prefix_ids + before
        self.between = between
        self.after = after + self.suffix_ids

    def piece_ids(self, piece: str) -> list[int]:
        return self.tokenizer(piece, add_special_tokens=False)["input_ids"] if piece.strip() else []

    @property
    def num_special_tokens(self) -> int:
        return 0

    def echo(self, ids: list[int], max_length: int | None) -> tuple[list[int], int, int]:
        """(row, first position of the second copy, its length)."""
        if max_length is not None:
            fixed = len(self.before) + len(self.between) + len(self.after)
            ids = ids[: max((max_length - fixed) // 2, 0)]
        ids = list(ids)
        start = len(self.before) + len(ids) + len(self.between)
        return self.before + ids + self.between + ids + self.after, start, len(ids)

    def wrap(self, ids: list[int], max_length: int | None) -> list[int]:
        return self.echo(ids, max_length)[0]

    def build(self, sentence_ids: list[list[int]], max_length: int | None) -> dict[str, Any]:
        rows, spans = [], []
        for ids in sentence_ids:
            row, start, length = self.echo(ids, max_length)
            rows.append(row)
            spans.append([0] * start + [1] * length + [0] * (len(row) - start - length))
        features = pad_rows(rows, self.pad_id)
        features["echo_mask"] = pad_ids(spans, 0)
        return features


class EchoEncoder(Encoder):
    """An `Encoder` whose rows are echo templates, pooled over the second copy (`echo_mean`, `echo_last`)."""

    reads_echo = True

    def __init__(self, backbone: str, pooler: str, template: str, with_mlm_head: bool = False) -> None:
        if pooler not in ECHO_POOLERS:
            raise SentEmbUserError(f"model.init_args.pooler: an echo template is pooled over its second copy, with "
                                   f"{' or '.join(ECHO_POOLERS)}; got {pooler!r}")
        super().__init__(backbone, pooler, with_mlm_head)
        self.format = EchoFormat(self.tokenizer, template)
