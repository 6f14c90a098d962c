"""BERT, RoBERTa and XLM-R: learned absolute positions, a pooler over [CLS]."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedConfig

from .family import BackboneFamily, EncoderFamily


class BertFamily(BackboneFamily):
    """BERT: positions 0, 1, ... from the row's start (HF's numbering, padding included)."""

    name = "bert"
    token_shuffle = "positions"  # learned absolute positions: ConSERT shuffles their ids (its paper's way)

    def position_ids(self, input_ids: Tensor | None, attention_mask: Tensor, past_length: int = 0) -> Tensor:
        positions = torch.arange(past_length, past_length + attention_mask.shape[1], device=attention_mask.device)
        return positions.unsqueeze(0).expand_as(attention_mask)


class RobertaPositions:
    """RoBERTa's position numbering: from `padding_idx + 1`, skipping pads (HF's
    `create_position_ids_from_input_ids`)."""

    config: PreTrainedConfig

    def first_position(self) -> int:
        return self.config.pad_token_id + 1

    def position_ids(self, input_ids: Tensor | None, attention_mask: Tensor, past_length: int = 0) -> Tensor:
        real = attention_mask.long() if input_ids is None else input_ids.ne(self.config.pad_token_id).long()
        return (real.cumsum(1) + past_length) * real + self.config.pad_token_id


class RobertaFamily(RobertaPositions, BertFamily):
    """RoBERTa / XLM-R: BERT's layers with RoBERTa's positions."""

    name = "roberta"


class RobertaPositionsEncoderFamily(RobertaPositions, EncoderFamily):
    """Other masked LMs that number positions RoBERTa's way (CamemBERT, MPNet, data2vec-text, XLM-R XL,
    ...): the positions templates and prefixes need."""
