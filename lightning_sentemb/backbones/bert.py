"""BERT, RoBERTa and XLM-R: learned absolute positions, post-norm layers, a pooler over [CLS]."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedConfig, PreTrainedModel

from ..encoders.packed import TokenLayout, sentence_attention
from .family import BackboneFamily, EncoderFamily


class BertFamily(BackboneFamily):
    """BERT: positions 0, 1, ... from the row's start (HF's numbering, padding included)."""

    name = "bert"
    prefix_through_cache = True  # BertSelfAttention takes past keys/values from a DynamicCache

    def packed_refusal(self) -> str | None:
        config = self.config
        if config.is_decoder or getattr(config, "add_cross_attention", False):
            return "decoder / cross-attention configuration"
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            return f"position_embedding_type {config.position_embedding_type!r}"
        if getattr(config, "chunk_size_feed_forward", 0):
            return "chunk_size_feed_forward"
        return None

    def position_ids(self, input_ids: Tensor | None, attention_mask: Tensor, past_length: int = 0) -> Tensor:
        positions = torch.arange(past_length, past_length + attention_mask.shape[1], device=attention_mask.device)
        return positions.unsqueeze(0).expand_as(attention_mask)

    # ----- packed forward ------------------------------------------------------------------
    def layers(self, backbone: PreTrainedModel) -> Sequence[nn.Module]:
        return backbone.encoder.layer

    def packed_embed(self, backbone: PreTrainedModel, layout: TokenLayout, input_ids: Tensor | None,
                     inputs_embeds: Tensor | None, positions: Tensor) -> tuple[Tensor, None]:
        """BertEmbeddings / RobertaEmbeddings: word (or given) + token type 0 + position, LayerNorm,
        dropout — HF's order of operations."""
        embeddings = backbone.embeddings
        words = embeddings.word_embeddings(layout.pack(input_ids)) if inputs_embeds is None else layout.pack(inputs_embeds)
        hidden = words + embeddings.token_type_embeddings.weight[0]
        hidden = hidden + embeddings.position_embeddings(positions)
        return embeddings.dropout(embeddings.LayerNorm(hidden)), None

    def packed_layer(self, layer: nn.Module, hidden: Tensor, layout: TokenLayout, context: None,
                     prefix: tuple[Tensor, Tensor] | None) -> Tensor:
        """One BertLayer / RobertaLayer on packed rows."""
        attended = layer.attention.output(self_attention(layer.attention.self, hidden, layout, prefix), hidden)
        return layer.output(layer.intermediate(attended), attended)


def self_attention(attention: nn.Module, hidden: Tensor, layout: TokenLayout,
                   prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """Q/K/V on the packed rows — one GEMM over the concatenated weights when the three are plain
    Linear layers (LoRA-wrapped ones are called as modules) — then attention per sentence."""
    heads, head_dim = attention.num_attention_heads, attention.attention_head_size
    projections = (attention.query, attention.key, attention.value)
    if all(type(p) is nn.Linear for p in projections):
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections])
        query, key, value = F.linear(hidden, weight, bias).view(-1, 3, heads, head_dim).unbind(1)
    else:
        query, key, value = (p(hidden).view(-1, heads, head_dim) for p in projections)
    dropout_p = attention.dropout.p if attention.training else 0.0
    return sentence_attention(query, key, value, layout, attention.scaling, dropout_p, prefix=prefix)


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
    ...): the padded forward, with the positions templates and prefixes need."""
