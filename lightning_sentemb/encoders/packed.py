"""Padding-free ("packed") forward of a Hugging Face BERT/RoBERTa encoder.

Batches stay padded (`input_ids` / `attention_mask`, the format every collate, gradient cache and
resume logic relies on); only the forward changes. Every token-wise module — embeddings, Q/K/V and
output projections, FFN, LayerNorm, dropout — runs on the `[real_tokens, hidden]` rows alone;
attention alone is re-padded per sentence (SDPA with a key mask; on CPU with dropout, the same math as
batched GEMMs, `cpu_dropout_attention`). On a wiki1m batch of 64 at
max_len 32 a third of the padded positions are padding, work the padded forward wastes.

The weights, module names and checkpoints are the HF model's own: this is a second layer loop over
the same modules, applying the same operations (dropout included, on the same tensors) in the same
order, so losses and gradients equal HF's padded forward up to float rounding (tested to 1e-5).
Padding positions of the returned states are zeros (HF leaves junk there); poolers mask them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")


def unsupported_reason(backbone: PreTrainedModel) -> str | None:
    """Why the packed forward cannot reproduce this backbone's padded forward, or None when it can."""
    config = backbone.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (packed forward supports {', '.join(SUPPORTED_MODEL_TYPES)})"
    if config.is_decoder or getattr(config, "add_cross_attention", False):
        return "decoder / cross-attention configuration"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"position_embedding_type {config.position_embedding_type!r}"
    if getattr(config, "chunk_size_feed_forward", 0):
        return "chunk_size_feed_forward"
    return None


def is_roberta_like(backbone: PreTrainedModel) -> bool:
    """RoBERTa-family embeddings number positions from padding_idx + 1 and skip pads."""
    return hasattr(backbone.embeddings, "create_position_ids_from_input_ids")


def default_position_ids(backbone: PreTrainedModel, input_ids: Tensor, past_length: int = 0) -> Tensor:
    """(batch, length) position ids the backbone gives a padded row after `past_length` cached tokens."""
    embeddings = backbone.embeddings
    if is_roberta_like(backbone):
        return embeddings.create_position_ids_from_input_ids(input_ids, embeddings.padding_idx, past_length)
    positions = torch.arange(past_length, past_length + input_ids.shape[1], device=input_ids.device)
    return positions.unsqueeze(0).expand_as(input_ids)


class Packing:
    """Where the real tokens of a padded (batch, length) mask sit in the flattened batch."""

    def __init__(self, attention_mask: Tensor) -> None:
        self.mask = attention_mask.bool()
        self.batch, self.length = self.mask.shape
        self.index = self.mask.flatten().nonzero().squeeze(1)  # the one host sync: the token count

    def pack(self, padded: Tensor) -> Tensor:
        """(batch, length, ...) -> (tokens, ...). `index_select`, not `[index]`: its backward is an
        index_add, several times faster on CPU than advanced indexing's accumulating index_put."""
        return padded.flatten(0, 1).index_select(0, self.index)

    def unpack(self, packed: Tensor) -> Tensor:
        """(tokens, ...) -> (batch, length, ...) with zeros at padding."""
        out = packed.new_zeros(self.batch * self.length, *packed.shape[1:])
        return out.index_copy(0, self.index, packed).unflatten(0, (self.batch, self.length))


def embed(backbone: PreTrainedModel, packing: Packing, input_ids: Tensor | None, inputs_embeds: Tensor | None,
          position_ids: Tensor) -> Tensor:
    """BertEmbeddings / RobertaEmbeddings on the real tokens: word (or given) + token type 0 + position,
    LayerNorm, dropout — HF's order of operations."""
    embeddings = backbone.embeddings
    if inputs_embeds is None:
        words = embeddings.word_embeddings(packing.pack(input_ids))
    else:
        words = packing.pack(inputs_embeds)
    hidden = words + embeddings.token_type_embeddings.weight[0]
    hidden = hidden + embeddings.position_embeddings(packing.pack(position_ids))
    return embeddings.dropout(embeddings.LayerNorm(hidden))


def self_attention(layer: nn.Module, hidden: Tensor, packing: Packing, prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """Q/K/V on the packed rows (one GEMM over the concatenated HF weights; the projection modules
    themselves when adapters such as peft's LoRA wrap them), attention per sentence on re-padded heads,
    back to packed rows. `prefix`: (key, value), each (batch, heads, prefix_len, head_dim), visible to
    every real token (DCPCSE)."""
    attention = layer.attention.self
    heads, head_dim = attention.num_attention_heads, attention.attention_head_size
    projections = (attention.query, attention.key, attention.value)
    if all(type(p) is nn.Linear for p in projections):
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections])
        qkv = F.linear(hidden, weight, bias)
    else:
        qkv = torch.cat([p(hidden) for p in projections], dim=-1)
    qkv = packing.unpack(qkv)  # (batch, length, 3 * heads * head_dim)
    query, key, value = qkv.view(packing.batch, packing.length, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    key_mask = packing.mask
    if prefix is not None:
        key = torch.cat([prefix[0].to(key.dtype), key], dim=2)
        value = torch.cat([prefix[1].to(value.dtype), value], dim=2)
        key_mask = torch.cat([key_mask.new_ones(packing.batch, prefix[0].shape[2]), key_mask], dim=1)
    dropout_p = attention.dropout.p if attention.training else 0.0
    if dropout_p > 0 and query.device.type == "cpu":
        context = cpu_dropout_attention(query, key, value, key_mask, dropout_p, attention.scaling)
    else:
        context = F.scaled_dot_product_attention(
            query, key, value, attn_mask=key_mask[:, None, None, :], dropout_p=dropout_p, scale=attention.scaling,
        )
    return packing.pack(context.transpose(1, 2).flatten(2))


def cpu_dropout_attention(query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor, dropout_p: float,
                          scale: float) -> Tensor:
    """softmax(scale · q kᵀ + mask) with dropout on the probabilities, times v: what
    `scaled_dot_product_attention` computes, written as batched GEMMs. With dropout on, SDPA on CPU
    falls back to its math kernel, which upcasts bf16 and copies every (batch, heads, length, length)
    tensor several times: 51 ms vs 21 ms forward + backward per layer at 128 × 12 × 32 × 32 in bf16
    autocast (4 ms less in fp32), the largest cost of a SimCSE step after the GEMMs.
    (batch, heads, length, head_dim) in and out; `key_mask` (batch, key_length), True at real keys."""
    batch, heads, length, head_dim = query.shape
    key_length = key.shape[2]
    bias = torch.zeros(key_mask.shape, dtype=query.dtype, device=query.device).masked_fill(~key_mask, float("-inf"))
    bias = bias[:, None, None, :].expand(batch, heads, length, key_length).reshape(batch * heads, length, key_length)
    scores = torch.baddbmm(bias, query.reshape(batch * heads, length, head_dim),
                           key.reshape(batch * heads, key_length, head_dim).transpose(1, 2), alpha=scale)
    probs = F.dropout(scores.softmax(-1), dropout_p)
    context = torch.bmm(probs.to(value.dtype), value.reshape(batch * heads, key_length, head_dim))
    return context.view(batch, heads, length, head_dim)


def encoder_layer(layer: nn.Module, hidden: Tensor, packing: Packing, prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """One BertLayer / RobertaLayer on packed rows."""
    attended = layer.attention.output(self_attention(layer, hidden, packing, prefix), hidden)
    return layer.output(layer.intermediate(attended), attended)


def packed_forward(
    backbone: PreTrainedModel,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    inputs_embeds: Tensor | None = None,
    prefix: list[tuple[Tensor, Tensor]] | None = None,
    past_length: int = 0,
    output_hidden_states: bool = False,
    layer_fn=encoder_layer,
) -> BaseModelOutputWithPoolingAndCrossAttentions:
    """The backbone's forward without computing on padding; same arguments and outputs as HF's
    (`last_hidden_state`, `hidden_states` padded, zeros at padding; no `pooler_output`).

    `prefix`: per-layer prefix keys/values; `past_length` shifts default position ids as HF does for
    cached tokens. `layer_fn` is `encoder_layer` or a compiled copy of it. Layers the backbone
    checkpoints (`gradient_checkpointing_enable`) are checkpointed here too, in training.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds")
    if attention_mask is None:
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        attention_mask = torch.ones(shape, dtype=torch.long, device=backbone.device)
    packing = Packing(attention_mask)
    if position_ids is None:
        if input_ids is None:
            raise ValueError("the packed forward needs position_ids with inputs_embeds")
        position_ids = default_position_ids(backbone, input_ids, past_length)
    hidden = embed(backbone, packing, input_ids, inputs_embeds, position_ids)
    states = [hidden]
    for index, layer in enumerate(backbone.encoder.layer):
        layer_prefix = None if prefix is None else prefix[index]
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            # the backbone's gradient checkpointing switch (HF's per-layer flag): recompute the layer in
            # backward, under the random state of its forward (same dropout masks)
            hidden = checkpoint(layer_fn, layer, hidden, packing, layer_prefix, use_reentrant=False)
        else:
            hidden = layer_fn(layer, hidden, packing, layer_prefix)
        states.append(hidden)
    return BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=packing.unpack(hidden),
        hidden_states=tuple(packing.unpack(s) for s in states) if output_hidden_states else None,
    )
