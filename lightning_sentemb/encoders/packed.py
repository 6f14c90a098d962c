"""Padding-free ("packed") forward: the backbone's own forward on one row of real tokens.

Batches stay padded (`input_ids` / `attention_mask`, the format every collate, gradient cache and
resume logic relies on); only the forward changes. `packed_forward` hands the model its real tokens
as one row (`(1, tokens)`), positions restarting at each sentence, and the sentence offsets as a
keyword argument (`sentemb_packing`) that transformers passes down to the attention function. Every
module of the model — embeddings, norms, projections, MLPs, LoRA wrappers, dropout — runs as it
always does, on real tokens only; attention alone needs to know where sentences start, and runs
through `sentemb_attention`, registered with transformers' attention interface once, as
`SENTEMB_ATTENTION`, with SDPA's mask function:

- on a padded batch (a padding-free backbone called directly, the padded forward of a bidirectional
  decoder or of DCPCSE's prefix) it is transformers' SDPA, with the prefix joined and causality off
  where asked;
- on the packed row it runs the kernels of `encoders.kernels`. `packed_forward` passes transformers a
  prepared 4D attention mask (`no_mask`, one element), which its mask creation hands on as it is: no
  (tokens × tokens) mask is built and the position ids are not searched for packed sequences (a
  read-back). The backbone's configuration is set once (`set_attention`) and never changes per call,
  so compiled layers see one implementation and nothing that shares the config sees a switch.

Whether an encoder runs packed is its own switch (`Encoder.padding_free`), not the backbone's attention
implementation. Any model whose attention goes through the interface (`_supports_attention_backend`)
and that takes `position_ids` runs packed; nothing here knows an architecture. The kernels and their
choice live in `encoders.kernels`; `TokenLayout` (where the real tokens sit, built on the CPU next to the
padded batch, so the forward never asks the device how many tokens there are) in `encoders.layout`.
Under autocast, query, key and value reach every kernel in the autocast dtype (rotary embeddings
hand over fp32 queries and keys). Padding positions of the returned states are zeros (transformers
leaves junk there); poolers mask them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_outputs import BaseModelOutput

from .kernels import Kernel, Packing, join_prefix, math_attention, run_kernel
from .layout import TokenLayout, layout_of

__all__ = ["SENTEMB_ATTENTION", "Kernel", "LayerPrefixes", "Packing", "TokenLayout", "layout_of", "packed_forward",
           "sentemb_attention", "set_attention"]

SENTEMB_ATTENTION = "sentemb"


@dataclass
class LayerPrefixes:
    """DCPCSE's per-layer prefix keys/values, each (batch, kv_heads, prefix_len, head_dim), found by
    attention module: `layer_of` maps a module to its layer, filled in call order on the first forward
    (layers attend in order; no architecture exposes its index the same way, DistilBERT none) and kept."""

    pairs: list[tuple[Tensor, Tensor]]
    layer_of: dict[nn.Module, int] = field(default_factory=dict)

    def of(self, module: nn.Module) -> tuple[Tensor, Tensor]:
        index = self.layer_of.setdefault(module, len(self.layer_of))
        if index >= len(self.pairs):
            raise RuntimeError(f"attention layer {index} has no prefix: the prefix has {len(self.pairs)} layers")
        return self.pairs[index]


def sentemb_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sentemb_packing: Packing | None = None,
    sentemb_prefix: LayerPrefixes | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention function transformers calls in every layer: (batch, heads, length, d) in,
    (batch, length, heads, d) out. Packed when the forward carries `sentemb_packing`, else SDPA on the
    padded batch; either way with the layer's DCPCSE prefix, visible to every token, when given."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if not getattr(module.config, "is_causal", True):  # a decoder made bidirectional (`Encoder.set_bidirectional`)
        causal, sliding_window, attention_mask = False, None, without_window(attention_mask, sliding_window)
        kwargs["is_causal"] = False  # SDPA without a mask (no padding) would read the module's flag
    prefix = None if sentemb_prefix is None else sentemb_prefix.of(module)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if torch.is_autocast_enabled(query.device.type):  # rotary embeddings return fp32 queries and keys
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if sentemb_packing is None:
        return padded_attention(module, query, key, value, attention_mask, dropout, scale, causal, softcap, prefix,
                                **kwargs)
    out = run_kernel(sentemb_packing, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                     scale, dropout, causal, sliding_window, softcap, prefix)
    return out[None], None


def without_window(mask: Tensor | None, window: int | None) -> Tensor | None:
    """The padding-only mask of a sliding-window layer's bidirectional (batch, 1, length, length) mask:
    every key lies in its own query's window, so the diagonal is the key padding mask."""
    if mask is None or not window:
        return mask
    return mask.diagonal(dim1=-2, dim2=-1)[..., None, :].expand_as(mask)


def padded_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                     dropout: float, scale: float, causal: bool, softcap: float | None,
                     prefix: tuple[Tensor, Tensor] | None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' SDPA on the padded batch; a prefix joins the keys, seen by every query (soft-capped
    layers: `math_attention`)."""
    if prefix is not None or softcap is not None:
        length = query.shape[2]
        if mask is None:  # SDPA's mask function leaves it out when `is_causal` alone (or nothing) masks
            mask = torch.ones(length, length, dtype=torch.bool, device=query.device)
            mask = mask.tril() if causal else mask
            mask = mask.expand(query.shape[0], 1, length, length)
        if prefix is not None:
            key, value, mask = join_prefix(key, value, mask, prefix)
        if softcap is not None:  # SDPA has no soft-capping
            return math_attention(query, key, value, mask, dropout, scale, softcap).transpose(1, 2), None
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scale, softcap=softcap,
                                  **kwargs)


AttentionInterface.register(SENTEMB_ATTENTION, sentemb_attention)
AttentionMaskInterface.register(SENTEMB_ATTENTION, sdpa_mask)


def set_attention(backbone: PreTrainedModel, implementation: str) -> None:
    """Route the backbone's attention through `implementation` (ours or one of transformers')."""
    if backbone.config._attn_implementation != implementation:
        backbone.set_attn_implementation(implementation)


def no_mask(device: torch.device) -> Tensor:
    """A prepared 4D attention mask of one element on `device`, which transformers' mask creation
    returns as it is (a 4D mask counts as prepared), so it builds none for the packed row; the packed path
    of `sentemb_attention` never reads it."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def packed_forward(
    backbone: PreTrainedModel,
    layout: TokenLayout,
    input_ids: Tensor | None = None,
    inputs_embeds: Tensor | None = None,
    position_ids: Tensor | None = None,
    prefix: LayerPrefixes | None = None,
    output_hidden_states: bool = False,
    kernel: Kernel = "auto",
) -> BaseModelOutput:
    """The backbone's own forward on the real tokens of a padded batch, as one row; its outputs
    (`last_hidden_state`, `hidden_states`) padded as the input, zeros at padding.

    `position_ids`: (batch, width) as the padded forward would use them (the family's numbering),
    packed so each sentence's restart; `prefix`: DCPCSE's per-layer keys/values."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds")
    tokens = {"input_ids": layout.pack(input_ids)[None]} if inputs_embeds is None else \
        {"inputs_embeds": layout.pack(inputs_embeds)[None]}
    if backbone.config._attn_implementation != SENTEMB_ATTENTION:
        raise RuntimeError(f"{type(backbone).__name__} is not set up for the packed forward (attention "
                           f"{backbone.config._attn_implementation!r}): set_attention(backbone, SENTEMB_ATTENTION)")
    packing = Packing(layout, kernel)
    row = next(iter(tokens.values()))
    outputs = backbone(**tokens, attention_mask=no_mask(row.device), position_ids=layout.pack(position_ids)[None],
                       use_cache=False, output_hidden_states=output_hidden_states, sentemb_packing=packing,
                       sentemb_prefix=prefix)
    if not packing.attended:
        raise RuntimeError(f"{type(backbone).__name__} computed attention without the attention interface (a config "
                           "option that bypasses it?); set model.init_args.padding_free false")
    return BaseModelOutput(
        last_hidden_state=layout.unpack(outputs.last_hidden_state[0]),
        hidden_states=tuple(layout.unpack(s[0]) for s in outputs.hidden_states) if output_hidden_states else None,
    )
