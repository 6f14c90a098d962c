"""Padding-free ("packed") forward: the backbone's own forward on one row of real tokens.

Batches stay padded (`input_ids` / `attention_mask`, the format every collate, gradient cache and
resume logic relies on); only the forward changes. `packed_forward` hands the model its real tokens
as one row (`(1, tokens)`), positions restarting at each sentence, and the sentence offsets as a
keyword argument (`sentemb_packing`) that transformers passes down to the attention function. Every
module of the model — embeddings, norms, projections, MLPs, LoRA wrappers, dropout — runs as it
always does, on real tokens only; attention alone needs to know where sentences start, and runs
through `sentemb_attention`, registered with transformers' attention interface under two names:

- `PACKED` (attention functions only): transformers builds no mask for it (its mask creation skips
  implementations it has no mask function for), so no (tokens × tokens) mask and no read-back;
- `PADDED` (with SDPA's mask function): the padded forward with SDPA, plus DCPCSE's prefix.

Any model whose attention goes through the interface (`_supports_attention_backend`) and that takes
`position_ids` runs packed; nothing here knows an architecture. Kernels (`packed_attention`):

- `aligned` (CPU, and the fallback): each sentence re-padded from position 0, SDPA with a key mask
  (with dropout on CPU: `math_attention`, batched GEMMs; also for logit soft-capping);
- `varlen` (CUDA, fp16/bf16, no attention dropout): torch's fused variable-length flash kernel
  (`torch.nn.attention.varlen.varlen_attn`) on the packed rows: causal, sliding windows and
  grouped-query attention in the kernel, no padding at all;
- `nested` (CUDA, fp16/bf16, attention dropout, no window): SDPA over nested jagged tensors, whose
  flash / memory-efficient kernels run variable lengths with dropout. It also runs on CPU (math
  kernel, bidirectional only), which is how the tests exercise it.

`TokenLayout` says where the real tokens sit; it is built on the CPU next to the padded batch
(`pad_rows`) and moved with it, so the forward never asks the device how many tokens there are.
Padding positions of the returned states are zeros (transformers leaves junk there); poolers mask them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_outputs import BaseModelOutput

PACKED = "sentemb_packed"
PADDED = "sentemb_padded"
Kernel = Literal["auto", "aligned", "varlen", "nested"]


class TokenLayout:
    """Where the real tokens of a padded (batch, width) batch sit.

    `index`: the flat position of every real token in the padded layout (row-major); `aligned`: its
    flat position once each sentence is moved to the start of its row (the `aligned` kernel's layout);
    `lengths`: tokens per row; `offsets`: where each sentence starts among the packed tokens (int32,
    batch + 1 entries, the fused kernels' `cu_seqlens`). Built on the CPU (`from_mask`), with the row
    lengths kept on the host as well, so the token count, the longest row and a gradient-cache chunk
    (`rows`) are known without reading anything back from the device. Lightning and the DataLoader move
    and pin it with the batch (`to`, `pin_memory`)."""

    def __init__(self, index: Tensor, aligned: Tensor, lengths: Tensor, offsets: Tensor, host_lengths: list[int],
                 width: int) -> None:
        self.index = index
        self.aligned = aligned
        self.lengths = lengths
        self.offsets = offsets
        self.host_lengths = host_lengths
        self.width = width

    @classmethod
    def from_mask(cls, attention_mask: Tensor) -> TokenLayout:
        """The layout of a (batch, width) 0/1 mask; on a GPU tensor this reads the mask back once."""
        mask = attention_mask.detach().to("cpu", torch.bool)
        lengths = mask.sum(1)
        width = mask.shape[1]
        aligned = torch.arange(width)[None] < lengths[:, None]
        offsets = F.pad(lengths.cumsum(0), (1, 0)).int()
        return cls(mask.flatten().nonzero().squeeze(1), aligned.flatten().nonzero().squeeze(1), lengths, offsets,
                   lengths.tolist(), width).to(attention_mask.device)

    @property
    def batch(self) -> int:
        return len(self.host_lengths)

    @property
    def max_length(self) -> int:
        return max(self.host_lengths)

    def _tensors(self) -> list[Tensor]:
        return [self.index, self.aligned, self.lengths, self.offsets]

    def to(self, device: torch.device | str, non_blocking: bool = True) -> TokenLayout:
        if self.index.device == torch.device(device):
            return self
        return TokenLayout(*[t.to(device, non_blocking=non_blocking) for t in self._tensors()], self.host_lengths,
                           self.width)

    def pin_memory(self) -> TokenLayout:
        return TokenLayout(*[t.pin_memory() for t in self._tensors()], self.host_lengths, self.width)

    def rows(self, span: slice) -> TokenLayout:
        """The layout of rows `span` alone (a gradient-cache chunk): token offsets from the host lengths."""
        first, last, step = span.indices(self.batch)
        if step != 1:
            raise ValueError(f"a layout is cut into consecutive rows, not {span}")
        start = sum(self.host_lengths[:first])
        stop = start + sum(self.host_lengths[first:last])
        shift = first * self.width
        return TokenLayout(self.index[start:stop] - shift, self.aligned[start:stop] - shift, self.lengths[first:last],
                           self.offsets[first:last + 1] - start, self.host_lengths[first:last], self.width)

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
        """(tokens, ...) -> (batch, width, ...) with each sentence from position 0."""
        return self._scatter(packed, self.aligned)

    def unalign(self, aligned: Tensor) -> Tensor:
        return aligned.flatten(0, 1).index_select(0, self.aligned)

    def _scatter(self, packed: Tensor, index: Tensor) -> Tensor:
        out = packed.new_zeros(self.batch * self.width, *packed.shape[1:])
        return out.index_copy(0, index, packed).unflatten(0, (self.batch, self.width))

    def key_mask(self) -> Tensor:
        """(batch, width) True at real tokens of the aligned layout."""
        return torch.arange(self.width, device=self.lengths.device)[None] < self.lengths[:, None]

    def with_prefix(self, key: Tensor, value: Tensor, prefix: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Packed keys and values (tokens, heads, d) with each sentence's prefix (batch, heads, prefix_len,
        d) put before it, and the offsets of those longer sequences: what a fused kernel takes."""
        batch, _, prefix_len, _ = prefix[0].shape
        tokens, device = key.shape[0], key.device
        sentence = torch.repeat_interleave(torch.arange(batch, device=device), self.lengths, output_size=tokens)
        token_dest = torch.arange(tokens, device=device) + (sentence + 1) * prefix_len
        starts = self.offsets[:-1].long() + torch.arange(batch, device=device) * prefix_len
        prefix_dest = (starts[:, None] + torch.arange(prefix_len, device=device)).flatten()

        def prepend(packed: Tensor, before: Tensor) -> Tensor:
            out = packed.new_empty(tokens + batch * prefix_len, *packed.shape[1:]).index_copy(0, token_dest, packed)
            return out.index_copy(0, prefix_dest, before.to(packed.dtype).transpose(1, 2).flatten(0, 1))

        offsets = self.offsets + prefix_len * torch.arange(batch + 1, device=device, dtype=self.offsets.dtype)
        return prepend(key, prefix[0]), prepend(value, prefix[1]), offsets


def layout_of(features: dict[str, Any]) -> TokenLayout:
    """The batch's `layout` (built with it), on the inputs' device; built here when absent (a batch
    made elsewhere, e.g. by sentence-transformers: one read-back of the mask)."""
    mask = features["attention_mask"]
    layout = features.get("layout")
    return TokenLayout.from_mask(mask) if layout is None else layout.to(mask.device)


@dataclass
class Packing:
    """What `sentemb_attention` is handed in a packed forward: the layout, the kernel to use, and
    whether any attention ran through it (a model that bypasses the interface must not pass silently)."""

    layout: TokenLayout
    kernel: Kernel = "auto"
    attended: bool = False


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
    if sentemb_packing is None:
        if module.config._attn_implementation == PACKED:
            raise RuntimeError("this backbone is set up for the packed forward: call it through packed_forward")
        return padded_attention(module, query, key, value, attention_mask, dropout, scale, causal, softcap, prefix,
                                **kwargs)
    sentemb_packing.attended = True
    out = packed_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                           sentemb_packing, scale, dropout, causal, sliding_window, softcap, prefix)
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


def join_prefix(key: Tensor, value: Tensor, mask: Tensor, prefix: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
    """(batch, heads, length, d) keys and values with the prefix's before them, and the boolean mask with
    the prefix visible to every query."""
    key = torch.cat([prefix[0].to(key.dtype), key], dim=2)
    value = torch.cat([prefix[1].to(value.dtype), value], dim=2)
    return key, value, torch.cat([mask.new_ones(*mask.shape[:-1], prefix[0].shape[2]), mask], dim=-1)


def packed_attention(query: Tensor, key: Tensor, value: Tensor, packing: Packing, scale: float, dropout_p: float,
                     causal: bool, window: int | None, softcap: float | None,
                     prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """Attention within each sentence of packed rows: query (tokens, heads, d), key and value
    (tokens, kv_heads, d) with kv_heads dividing heads; returns (tokens, heads, d). `window`:
    transformers' `sliding_window`, keys closer than that (causal: at most window - 1 back;
    bidirectional: |i - j| < window). The kernel is the packing's, or picked as the module says."""
    kernel = packing.kernel
    if kernel == "auto":
        # a prefix makes keys longer than queries: the fused kernels get it on bidirectional layers only
        fused = (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and softcap is None
                 and (prefix is None or not (causal or window)))
        if fused and dropout_p == 0:
            kernel = "varlen"
        elif fused and not window:
            kernel = "nested"
        else:
            kernel = "aligned"
    if kernel == "varlen":
        return varlen_attention(query, key, value, packing.layout, scale, causal, window, prefix)
    if kernel == "nested":
        if causal and not query.is_cuda or window or softcap is not None:
            raise ValueError("the nested kernel runs neither windows nor soft-capping, nor causal attention on CPU")
        return nested_attention(query, key, value, packing.layout, scale, dropout_p, causal, prefix)
    return aligned_attention(query, key, value, packing.layout, scale, dropout_p, causal, window, softcap, prefix)


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, layout: TokenLayout, scale: float, causal: bool,
                     window: int | None, prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """torch's fused variable-length flash kernel; a prefix makes each sentence's keys longer than its
    queries (`auto` sends it here on bidirectional layers only)."""
    from torch.nn.attention.varlen import varlen_attn

    key_offsets, key_max = layout.offsets, layout.max_length
    if prefix is not None:
        key, value, key_offsets = layout.with_prefix(key, value, prefix)
        key_max += prefix[0].shape[2]
    reach = -1 if window is None else window - 1
    window_size = (reach, 0 if causal else reach)
    query, key, value = (t.contiguous() for t in (query, key, value))  # rotary models hand over strided views
    return varlen_attn(query, key, value, layout.offsets, key_offsets, layout.max_length, key_max, scale=scale,
                       window_size=window_size, enable_gqa=key.shape[1] != query.shape[1])


def nested_attention(query: Tensor, key: Tensor, value: Tensor, layout: TokenLayout, scale: float, dropout_p: float,
                     causal: bool, prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """SDPA over nested jagged tensors (flash / memory-efficient kernels with dropout on CUDA).
    Grouped-query keys are repeated per head here: the nested kernels take no `enable_gqa`."""
    key_offsets, extra = layout.offsets, 0
    if prefix is not None:
        key, value, key_offsets = layout.with_prefix(key, value, prefix)
        extra = prefix[0].shape[2]
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))
    shortest, longest = min(layout.host_lengths), layout.max_length  # from the host: no read-back

    def nested(values: Tensor, offsets: Tensor, more: int = 0) -> Tensor:
        return torch.nested.nested_tensor_from_jagged(values, offsets.long(), min_seqlen=shortest + more,
                                                      max_seqlen=longest + more).transpose(1, 2)

    out = F.scaled_dot_product_attention(nested(query, layout.offsets), nested(key, key_offsets, extra),
                                         nested(value, key_offsets, extra), dropout_p=dropout_p, is_causal=causal,
                                         scale=scale)
    return out.transpose(1, 2).values()


def aligned_attention(query: Tensor, key: Tensor, value: Tensor, layout: TokenLayout, scale: float, dropout_p: float,
                      causal: bool, window: int | None, softcap: float | None,
                      prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """Each sentence re-padded from position 0 (causal and windowed masks are then plain triangles and
    bands, whichever side the batch was padded on), SDPA with a boolean mask, or `math_attention`
    (dropout on CPU, soft-capping)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    query, key, value = (layout.align(t).transpose(1, 2) for t in (query, key, value))  # (batch, h, width, d)
    real = layout.key_mask()
    mask = real[:, None, None, :]
    if causal or window:
        positions = torch.arange(layout.width, device=query.device)
        distance = positions[:, None] - positions[None, :]
        allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
        if window:
            allowed &= distance.abs() < window
        # padding queries (dropped afterwards) see every key: a row with none would make a NaN, and the
        # backward 0 · NaN in the real keys' gradients
        mask = (mask & allowed) | ~real[:, None, :, None]
    if prefix is not None:
        key, value, mask = join_prefix(key, value, mask, prefix)
    if (dropout_p > 0 and query.device.type == "cpu") or softcap is not None:
        context = math_attention(query, key, value, mask, dropout_p, scale, softcap)
    else:
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                                 enable_gqa=kv_heads != heads)
    return layout.unalign(context.transpose(1, 2))


def math_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, dropout_p: float, scale: float,
                   softcap: float | None = None) -> Tensor:
    """softmax(scale · q kᵀ + mask) with dropout on the probabilities, times v: what
    `scaled_dot_product_attention` computes, written as batched GEMMs. With dropout on, SDPA on CPU
    falls back to its math kernel, which upcasts bf16 and copies every (batch, heads, length, length)
    tensor several times: 51 ms vs 21 ms forward + backward per layer at 128 × 12 × 32 × 32 in bf16
    autocast. `softcap`: scores soft-capped as cap · tanh(scores / cap) before the mask (Gemma-2).
    query (batch, heads, length, d); key, value (batch, kv_heads, key_length, d): the query heads of a
    key/value head are stacked along the length instead of copying its keys per head. `mask` broadcasts
    to (batch, heads, length, key_length), True where a query may see a key."""
    batch, heads, length, head_dim = query.shape
    kv_heads, key_length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    rows = batch * kv_heads
    query = query.reshape(rows, groups * length, head_dim)
    allowed = mask.expand(batch, heads, length, key_length).reshape(rows, groups * length, key_length)
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, float("-inf"))
    keys_t = key.reshape(rows, key_length, head_dim).transpose(1, 2)
    if softcap is None:
        scores = torch.baddbmm(bias, query, keys_t, alpha=scale)
    else:
        scores = torch.tanh(torch.bmm(query, keys_t) * (scale / softcap)) * softcap + bias
    probs = F.dropout(scores.softmax(-1), dropout_p)
    context = torch.bmm(probs.to(value.dtype), value.reshape(rows, key_length, head_dim))
    return context.view(batch, heads, length, head_dim)


AttentionInterface.register(PACKED, sentemb_attention)
AttentionInterface.register(PADDED, sentemb_attention)
AttentionMaskInterface.register(PADDED, sdpa_mask)


def set_attention(backbone: PreTrainedModel, implementation: str) -> None:
    """Route the backbone's attention through `implementation` (ours or one of transformers')."""
    if backbone.config._attn_implementation != implementation:
        backbone.set_attn_implementation(implementation)


def is_packed(backbone: PreTrainedModel) -> bool:
    return backbone.config._attn_implementation == PACKED


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
    packing = Packing(layout, kernel)
    outputs = backbone(**tokens, position_ids=layout.pack(position_ids)[None], use_cache=False,
                       output_hidden_states=output_hidden_states, sentemb_packing=packing, sentemb_prefix=prefix)
    if not packing.attended:
        raise RuntimeError(f"{type(backbone).__name__} computed attention without the attention interface (a config "
                           "option that bypasses it?); set model.init_args.padding_free false")
    return BaseModelOutput(
        last_hidden_state=layout.unpack(outputs.last_hidden_state[0]),
        hidden_states=tuple(layout.unpack(s[0]) for s in outputs.hidden_states) if output_hidden_states else None,
    )
