"""Padding-free ("packed") forward: token-wise work on the real tokens only, attention per sentence.

Batches stay padded (`input_ids` / `attention_mask`, the format every collate, gradient cache and
resume logic relies on); only the forward changes. Every token-wise module — embeddings, Q/K/V and
output projections, FFN, norms, dropout — runs on the `[real_tokens, hidden]` rows alone; attention
alone is re-padded per sentence into a left-aligned layout (SDPA with a boolean mask; on CPU with
dropout, the same math as batched GEMMs, `cpu_dropout_attention`). On a wiki1m batch of 64 at
max_len 32 a third of the padded positions are padding, work the padded forward wastes.

What differs per architecture (embeddings, the layer, positions) is the backbone family's
(`lightning_sentemb.backbones`); this module holds what every family shares: `TokenLayout`, where the
real tokens sit, built on the CPU next to the padded batch (`pad_rows`) and moved with it, so the
forward never asks the device how many tokens there are (no host synchronisation); and
`sentence_attention`.

The weights, module names and checkpoints are the HF model's own: a family's packed layer is a
second loop over the same modules, applying the same operations (dropout included) in the same
order, so losses and gradients equal HF's padded forward up to float rounding (tested to 1e-5).
Padding positions of the returned states are zeros (HF leaves junk there); poolers mask them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

if TYPE_CHECKING:
    from ..backbones.family import BackboneFamily


class TokenLayout:
    """Where the real tokens of a padded (batch, width) batch sit.

    `index`: the flat position of every real token in the padded layout (row-major); `aligned`: its
    flat position once each sentence is moved to the start of its row (the layout attention runs on:
    causal and windowed masks are then plain triangles and bands, whatever side the batch was padded
    on); `lengths`: tokens per row. Built on the CPU (`from_mask`) where counting tokens is free, with
    the row lengths kept on the host as well, so a gradient-cache chunk (`rows`) is cut without
    reading anything back from the device. Lightning and the DataLoader move and pin it with the
    batch (`to`, `pin_memory`)."""

    def __init__(self, index: Tensor, aligned: Tensor, lengths: Tensor, host_lengths: list[int], width: int) -> None:
        self.index = index
        self.aligned = aligned
        self.lengths = lengths
        self.host_lengths = host_lengths
        self.width = width

    @classmethod
    def from_mask(cls, attention_mask: Tensor) -> TokenLayout:
        """The layout of a (batch, width) 0/1 mask; on a GPU tensor this reads the mask back once."""
        mask = attention_mask.detach().to("cpu", torch.bool)
        lengths = mask.sum(1)
        width = mask.shape[1]
        aligned = torch.arange(width)[None] < lengths[:, None]
        return cls(mask.flatten().nonzero().squeeze(1), aligned.flatten().nonzero().squeeze(1), lengths,
                   lengths.tolist(), width).to(attention_mask.device)

    @property
    def batch(self) -> int:
        return len(self.host_lengths)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> TokenLayout:
        if self.index.device == torch.device(device):
            return self
        move = [t.to(device, non_blocking=non_blocking) for t in (self.index, self.aligned, self.lengths)]
        return TokenLayout(*move, self.host_lengths, self.width)

    def pin_memory(self) -> TokenLayout:
        pinned = [t.pin_memory() for t in (self.index, self.aligned, self.lengths)]
        return TokenLayout(*pinned, self.host_lengths, self.width)

    def rows(self, span: slice) -> TokenLayout:
        """The layout of rows `span` alone (a gradient-cache chunk): token offsets from the host lengths."""
        first, last, step = span.indices(self.batch)
        if step != 1:
            raise ValueError(f"a layout is cut into consecutive rows, not {span}")
        start = sum(self.host_lengths[:first])
        stop = start + sum(self.host_lengths[first:last])
        shift = first * self.width
        return TokenLayout(self.index[start:stop] - shift, self.aligned[start:stop] - shift, self.lengths[first:last],
                           self.host_lengths[first:last], self.width)

    def __getitem__(self, span: slice) -> TokenLayout:
        return self.rows(span)

    # ----- moving tensors between layouts ---------------------------------------------------
    def pack(self, padded: Tensor) -> Tensor:
        """(batch, width, ...) -> (tokens, ...). `index_select`, not `[index]`: its backward is an
        index_add, several times faster on CPU than advanced indexing's accumulating index_put."""
        return padded.flatten(0, 1).index_select(0, self.index)

    def unpack(self, packed: Tensor) -> Tensor:
        """(tokens, ...) -> (batch, width, ...) in the input's layout, zeros at padding."""
        return self._scatter(packed, self.index)

    def align(self, packed: Tensor) -> Tensor:
        """(tokens, ...) -> (batch, width, ...) with each sentence from position 0 (attention's layout)."""
        return self._scatter(packed, self.aligned)

    def unalign(self, aligned: Tensor) -> Tensor:
        return aligned.flatten(0, 1).index_select(0, self.aligned)

    def _scatter(self, packed: Tensor, index: Tensor) -> Tensor:
        out = packed.new_zeros(self.batch * self.width, *packed.shape[1:])
        return out.index_copy(0, index, packed).unflatten(0, (self.batch, self.width))

    def key_mask(self) -> Tensor:
        """(batch, width) True at real tokens of the aligned layout."""
        return torch.arange(self.width, device=self.lengths.device)[None] < self.lengths[:, None]


def layout_of(features: dict[str, Any]) -> TokenLayout:
    """The batch's `layout` (built with it), on the inputs' device; built here when absent (a batch
    made elsewhere, e.g. by sentence-transformers: one read-back of the mask)."""
    mask = features["attention_mask"]
    layout = features.get("layout")
    return TokenLayout.from_mask(mask) if layout is None else layout.to(mask.device)


def sentence_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: TokenLayout,
    scale: float,
    dropout_p: float = 0.0,
    causal: bool = False,
    window: int | None = None,
    prefix: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Attention within each sentence of packed rows.

    query (tokens, heads, head_dim); key, value (tokens, kv_heads, head_dim) with kv_heads dividing
    heads (grouped-query attention); returns (tokens, heads * head_dim). `causal`: each token sees
    itself and earlier tokens; `window`: only keys within that distance (|i - j| <= window, ModernBERT's
    local layers); `prefix`: (key, value) of shape (batch, kv_heads, prefix_len, head_dim) that every
    token of its row sees (DCPCSE)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    query, key, value = (layout.align(t).transpose(1, 2) for t in (query, key, value))  # (batch, h, width, d)
    width = layout.width
    mask = layout.key_mask()[:, None, None, :]
    if causal or window is not None:
        positions = torch.arange(width, device=query.device)
        distance = positions[:, None] - positions[None, :]
        allowed = torch.ones(width, width, dtype=torch.bool, device=query.device)
        if causal:
            allowed &= distance >= 0
        if window is not None:
            allowed &= distance.abs() <= window
        # padding queries (dropped afterwards) see every key: a row with none would make a NaN, and the
        # backward 0 · NaN in the real keys' gradients
        mask = (mask & allowed) | ~layout.key_mask()[:, None, :, None]
    if prefix is not None:
        key = torch.cat([prefix[0].to(key.dtype), key], dim=2)
        value = torch.cat([prefix[1].to(value.dtype), value], dim=2)
        seen = mask.new_ones(*mask.shape[:-1], prefix[0].shape[2])
        mask = torch.cat([seen, mask], dim=-1)
    if kv_heads != heads:  # each key/value head serves heads // kv_heads query heads (expand: a cheap backward)
        batch, _, key_length, head_dim = key.shape
        key, value = (t[:, :, None].expand(batch, kv_heads, heads // kv_heads, key_length, head_dim)
                      .reshape(batch, heads, key_length, head_dim) for t in (key, value))
    if dropout_p > 0 and query.device.type == "cpu":
        context = cpu_dropout_attention(query, key, value, mask, dropout_p, scale)
    else:
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return layout.unalign(context.transpose(1, 2).flatten(2))


def cpu_dropout_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, dropout_p: float,
                          scale: float) -> Tensor:
    """softmax(scale · q kᵀ + mask) with dropout on the probabilities, times v: what
    `scaled_dot_product_attention` computes, written as batched GEMMs. With dropout on, SDPA on CPU
    falls back to its math kernel, which upcasts bf16 and copies every (batch, heads, length, length)
    tensor several times: 51 ms vs 21 ms forward + backward per layer at 128 × 12 × 32 × 32 in bf16
    autocast (4 ms less in fp32), the largest cost of a SimCSE step after the GEMMs.
    (batch, heads, length, head_dim) in and out; `mask` broadcasts to (batch, heads, length, key_length),
    True where a query may see a key."""
    batch, heads, length, head_dim = query.shape
    key_length = key.shape[2]
    allowed = mask.expand(batch, heads, length, key_length)
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, float("-inf"))
    scores = torch.baddbmm(bias.reshape(batch * heads, length, key_length), query.reshape(batch * heads, length, head_dim),
                           key.reshape(batch * heads, key_length, head_dim).transpose(1, 2), alpha=scale)
    probs = F.dropout(scores.softmax(-1), dropout_p)
    context = torch.bmm(probs.to(value.dtype), value.reshape(batch * heads, key_length, head_dim))
    return context.view(batch, heads, length, head_dim)


def packed_forward(
    backbone: PreTrainedModel,
    family: BackboneFamily,
    layout: TokenLayout,
    input_ids: Tensor | None = None,
    inputs_embeds: Tensor | None = None,
    position_ids: Tensor | None = None,
    prefix: list[tuple[Tensor, Tensor]] | None = None,
    output_hidden_states: bool = False,
    layer_fn=None,
) -> BaseModelOutput:
    """The backbone's forward without computing on padding; HF's outputs (`last_hidden_state`,
    `hidden_states`), padded as the input, zeros at padding.

    `position_ids`: (batch, width) as the padded forward would use them (the family's
    `position_ids`); `prefix`: per-layer prefix keys/values; `layer_fn` is the family's
    `packed_layer` or a compiled copy of it. Layers the backbone checkpoints
    (`gradient_checkpointing_enable`) are checkpointed here too, in training."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds")
    layer_fn = layer_fn or family.packed_layer
    hidden, context = family.packed_embed(backbone, layout, input_ids, inputs_embeds, layout.pack(position_ids))
    states = [hidden]
    for index, layer in enumerate(family.layers(backbone)):
        layer_prefix = None if prefix is None else prefix[index]
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            # the backbone's gradient checkpointing switch (HF's per-layer flag): recompute the layer in
            # backward, under the random state of its forward (same dropout masks)
            hidden = checkpoint(layer_fn, layer, hidden, layout, context, layer_prefix, use_reentrant=False)
        else:
            hidden = layer_fn(layer, hidden, layout, context, layer_prefix)
        states.append(hidden)
    last = family.packed_final(backbone, hidden)
    if output_hidden_states:
        states[-1] = last
    return BaseModelOutput(
        last_hidden_state=layout.unpack(last),
        hidden_states=tuple(layout.unpack(s) for s in states) if output_hidden_states else None,
    )
