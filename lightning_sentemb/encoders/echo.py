"""Echo embeddings (Springer et al., ICLR 2025, "Repetition Improves Language Model Embeddings"): a causal
model reads the sentence twice and is pooled over the second copy only, whose every token has seen the
whole sentence in the first.

The template is text with `[X]` twice (default `ECHO_TEMPLATE`, the paper's wording). A row is the
tokenization of the whole text, the sentence written into both slots, exactly as the tokenizer makes it of
that string: tokenizing the pieces apart would not be (with a byte-level BPE, `": "` then `"the cat"` gives
`':', 'Ġ', 'the', 'Ġcat'` where the text gives `':', 'Ġthe', 'Ġcat'`). The sentence's text is its cached
ids decoded, cut as before to what fits the row (each copy at most half of what the template leaves). The
second copy's tokens are those whose characters (the tokenizer's offsets) overlap it: where the tokenizer
merges text across the copy's edge, the merged token belongs to it. The reference
(jakespringer/echo-embeddings) tokenizes pieces apart, with templates that put no space before a copy.

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
    """The sentence twice inside an echo template, the whole text tokenized at once (the tokenizer's special
    tokens around it), with `echo_mask` over the second copy. `num_special_tokens` is 0: `max_seq_len` is the
    sentence's own budget, the template comes on top (as `TemplateFormat`); at evaluation each copy is cut
    so the row fits."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str) -> None:
        super().__init__(tokenizer)
        self.template = echo_template(template)
        self.pieces = self.template.split("[X]")
        if len(self.pieces) != 3:
            raise SentEmbUserError(f"model.init_args.template {template!r}: an echo template holds [X] exactly twice "
                                   f"(e.g. {ECHO_TEMPLATE!r})")
        if not tokenizer.is_fast:
            raise SentEmbUserError(f"model.init_args.template {template!r}: echo templates need a fast tokenizer "
                                   f"(its character offsets find the second copy); {type(tokenizer).__name__} is not")
        self.template_length = len(tokenizer("".join(self.pieces))["input_ids"])  # special tokens included

    @property
    def num_special_tokens(self) -> int:
        return 0

    def echo(self, sentences: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """(rows, second-copy masks): each text written twice into the template and tokenized whole."""
        first, between, after = self.pieces
        texts = [first + text + between + text + after for text in sentences]
        encoded = self.tokenizer(texts, return_offsets_mapping=True)
        masks = []
        for text, offsets in zip(sentences, encoded["offset_mapping"], strict=True):
            start = len(first) + len(text) + len(between)
            end = start + len(text)
            masks.append([int(begin < end and stop > start) for begin, stop in offsets])
        return encoded["input_ids"], masks

    def rows(self, sentence_ids: list[list[int]], max_length: int | None) -> tuple[list[list[int]], list[list[int]]]:
        """`echo` of the sentences, each cut to half of what the template leaves of `max_length` (then a
        token less while the whole text is still too long: tokenizing it whole may merge or split
        differently)."""
        if max_length is not None:
            sentence_ids = [ids[: max((max_length - self.template_length) // 2, 0)] for ids in sentence_ids]
        decode = self.tokenizer.batch_decode
        rows, masks = self.echo(decode(sentence_ids, clean_up_tokenization_spaces=False))
        for i, ids in enumerate(sentence_ids):
            while max_length is not None and len(rows[i]) > max_length and ids:
                ids = ids[:-1]
                (rows[i],), (masks[i],) = self.echo(decode([ids], clean_up_tokenization_spaces=False))
        return rows, masks

    def wrap(self, ids: list[int], max_length: int | None) -> list[int]:
        return self.rows([ids], max_length)[0][0]

    def build(self, sentence_ids: list[list[int]], max_length: int | None) -> dict[str, Any]:
        rows, masks = self.rows(sentence_ids, max_length)
        features = pad_rows(rows, self.pad_id)
        features["echo_mask"] = pad_ids(masks, 0)
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
