"""The shared encoder: a Hugging Face backbone, an input format and a pooler.

Methods differ in how they format the input (plain, discrete template, continuous prompt,
deep prefix); everything else — loading, pooling, batching for evaluation — lives here once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer, PreTrainedTokenizerBase

from .packed import encoder_layer, packed_forward, unsupported_reason
from .pretrained import load_pretrained, resolve_model_path  # noqa: F401  (re-exported: their old home)

log = logging.getLogger(__name__)

POOLERS = ("cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2", "mask")


class PlainFormat:
    """`[CLS] sentence [SEP]` (or `<s> sentence </s>`): the sentence is the whole input.

    Sentences are tokenized once without special tokens (the DataModule caches these ids);
    `build` adds the special tokens, truncates the sentence and pads. Keeping the two steps
    apart lets prompt formats wrap the same cached ids in their templates.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        specials = tokenizer("")["input_ids"]
        self.prefix_ids: list[int] = specials[:1]
        self.suffix_ids: list[int] = specials[1:]
        self.pad_id: int = tokenizer.pad_token_id

    @property
    def num_special_tokens(self) -> int:
        return len(self.prefix_ids) + len(self.suffix_ids)

    def sentence_ids(self, sentences: list[str]) -> list[list[int]]:
        """Token ids of each sentence alone (no special tokens, no truncation)."""
        return self.tokenizer(list(sentences), add_special_tokens=False)["input_ids"]

    def wrap(self, ids: list[int], max_length: int | None) -> list[int]:
        """One row: special tokens around the sentence, the sentence cut so the row fits max_length."""
        if max_length is not None:
            ids = ids[: max(max_length - self.num_special_tokens, 0)]
        return self.prefix_ids + list(ids) + self.suffix_ids

    def build(self, sentence_ids: list[list[int]], max_length: int | None) -> dict[str, Tensor]:
        """Padded `input_ids` and `attention_mask` for a list of tokenized sentences."""
        return pad_rows([self.wrap(ids, max_length) for ids in sentence_ids], self.pad_id)


def pad_rows(rows: list[list[int]], pad_id: int) -> dict[str, Tensor]:
    """Right-pad id rows into `input_ids` / `attention_mask` tensors."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def masked_mean(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)


def pool(
    pooler: str,
    outputs: Any,
    attention_mask: Tensor,
    input_ids: Tensor | None = None,
    mask_token_id: int | None = None,
    first_hidden_index: int = 1,
) -> Tensor:
    """Sentence vector from backbone outputs.

    `attention_mask` must cover the sentence tokens only (never a prefix-extended mask).
    `avg_first_last` averages hidden_states[first_hidden_index] and the last layer:
    index 1 (first transformer layer, default) follows BERT-whitening and SimCSE's current code;
    index 0 (the embedding output) is what SimCSE's first release used.
    """
    if pooler in ("cls", "cls_before_pooler"):
        return outputs.last_hidden_state[:, 0]
    if pooler == "avg":
        return masked_mean(outputs.last_hidden_state, attention_mask)
    if pooler == "avg_first_last":
        states = outputs.hidden_states
        return masked_mean((states[first_hidden_index] + states[-1]) / 2.0, attention_mask)
    if pooler == "avg_top2":
        states = outputs.hidden_states
        return masked_mean((states[-1] + states[-2]) / 2.0, attention_mask)
    if pooler == "mask":
        is_mask = input_ids == mask_token_id
        if not bool((is_mask.sum(1) == 1).all()):
            raise ValueError("pooler 'mask' needs exactly one mask token in every row; check the template.")
        return outputs.last_hidden_state[is_mask]
    raise ValueError(f"unknown pooler {pooler!r}; choose one of {', '.join(POOLERS)}")


class Encoder(nn.Module):
    """Backbone + pooler. `forward(features) -> (batch, hidden)` sentence vectors.

    With `with_mlm_head` the backbone is loaded through AutoModelForMaskedLM so the checkpoint's
    MLM head is used when it has one; a checkpoint without one (e.g. all-MiniLM-L6-v2) gets a fresh
    head whose decoder is tied to the word embeddings.

    Speed switches (set by the method from `padding_free` / `compile_layers`, see `configure_speed`):
    the padding-free forward (`encoders.packed`) is on by default wherever it is exact; the MLM
    auxiliary head stays on the padded forward.
    """

    padding_free: bool = True
    layer_fn = staticmethod(encoder_layer)

    def __init__(
        self,
        backbone: str,
        pooler: str = "cls",
        with_mlm_head: bool = False,
        first_hidden_index: int = 1,
    ) -> None:
        super().__init__()
        if pooler not in POOLERS:
            raise ValueError(f"unknown pooler {pooler!r}; choose one of {', '.join(POOLERS)}")
        self.name_or_path = backbone
        self.pooler = pooler
        self.first_hidden_index = first_hidden_index
        self.tokenizer = load_pretrained(AutoTokenizer, backbone)
        if with_mlm_head:
            self.mlm_model = load_pretrained(AutoModelForMaskedLM, backbone)
            self.backbone = self.mlm_model.base_model
        else:
            self.mlm_model = None
            self.backbone = load_pretrained(AutoModel, backbone)
        # from_pretrained returns eval mode; Lightning keeps module modes, and dropout is
        # SimCSE's augmentation, so start in train mode like a freshly built module.
        self.train()
        # The backbone's own pooler (BERT/RoBERTa's Linear+Tanh over [CLS]) feeds none of the poolers
        # here, so it never gets a gradient: frozen, else DDP stops on unused parameters. (Kept, not
        # dropped: `load_method(pooler="cls")` and the export read and write its weights.)
        if getattr(self.backbone, "pooler", None) is not None:
            self.backbone.pooler.requires_grad_(False)
        self.format = PlainFormat(self.tokenizer)

    @property
    def hidden_size(self) -> int:
        return self.backbone.config.hidden_size

    @property
    def max_length(self) -> int:
        return min(self.tokenizer.model_max_length, self.backbone.config.max_position_embeddings)

    def configure_speed(self, padding_free: bool, compile_layers: bool) -> None:
        """Padding-free forward where the backbone supports it (else the padded one, with the reason
        logged); `compile_layers` compiles the packed layer with dynamic token counts, so a new batch
        length does not recompile."""
        reason = unsupported_reason(self.backbone) if padding_free else None
        if reason is not None:
            log.warning("padding-free forward off for %s: %s; using the padded forward", self.name_or_path, reason)
        self.padding_free = padding_free and reason is None
        if compile_layers and not self.padding_free:
            log.warning("compile_layers applies to the padding-free forward only; it is off here")
        self.layer_fn = torch.compile(encoder_layer, dynamic=True) if compile_layers and self.padding_free else encoder_layer

    def call_backbone(self, **inputs: Any) -> Any:
        """`self.backbone(**inputs)`, padding-free when switched on (same outputs at real tokens)."""
        if self.padding_free:
            return packed_forward(self.backbone, layer_fn=self.layer_fn, **inputs)
        return self.backbone(**inputs)

    def run_backbone(self, features: dict[str, Tensor]) -> Any:
        """The backbone forward; input formats that inject prompts or prefixes override this."""
        return self.call_backbone(
            input_ids=features["input_ids"],
            attention_mask=features["attention_mask"],
            output_hidden_states=self.pooler in ("avg_first_last", "avg_top2"),
        )

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        """(sentences, hidden): the pooled state of every input row, combined by `combine_rows`."""
        rows = pool(
            self.pooler,
            self.run_backbone(features),
            features["attention_mask"],
            features["input_ids"],
            self.tokenizer.mask_token_id,
            self.first_hidden_index,
        )
        return self.combine_rows(rows, features)

    # Feature keys that describe the whole batch rather than one row (read by `combine_rows`):
    # gradient caching slices every other key by rows.
    combine_keys: tuple[str, ...] = ()

    def combine_rows(self, row_states: Tensor, features: dict[str, Tensor]) -> Tensor:
        """Sentence vectors from the pooled states of every input row: the rows themselves here
        (formats with extra rows, e.g. template bias rows, override). `forward` on features
        without `combine_keys` gives the row states, so they can be computed in chunks."""
        return row_states

    def mlm_logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        if self.mlm_model is None:
            raise RuntimeError("this encoder was built without an MLM head (with_mlm_head=False)")
        return self.mlm_model(input_ids=input_ids, attention_mask=attention_mask).logits
