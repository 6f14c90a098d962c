"""Decoder LLMs of the Llama shape — Llama, Mistral, Qwen2, Qwen3, Gemma: token embeddings, pre-norm
layers (RMSNorm, rotary positions, grouped-query causal attention, gated MLP), a final RMSNorm.

The packed forward calls each layer's own modules (norms, projections, MLP: LoRA-wrapped ones too)
and runs causal attention within each sentence, rotary positions counted from each sentence's first
token; what the families differ in lives in those modules (Gemma's scaled embeddings and (1 + w)
norms, Qwen2's Q/K/V biases), except Qwen3's per-head Q/K norms (`Qwen3Family`) and sliding windows
(refused where they could cut a sentence).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..encoders.packed import TokenLayout, sentence_attention
from .family import DecoderFamily


class LlamaFamily(DecoderFamily):
    name = "llama"

    def packed_refusal(self) -> str | None:
        """Exact unless a sliding window is shorter than the longest input the model takes."""
        config = self.config
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        windowed = window is not None and (layer_types is None or "sliding_attention" in layer_types)
        if windowed and window < config.max_position_embeddings:
            return f"sliding_window {window} < max_position_embeddings {config.max_position_embeddings}"
        return None

    def layers(self, backbone: PreTrainedModel) -> Sequence[nn.Module]:
        return backbone.layers

    def packed_embed(self, backbone: PreTrainedModel, layout: TokenLayout, input_ids: Tensor | None,
                     inputs_embeds: Tensor | None, positions: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        hidden = backbone.embed_tokens(layout.pack(input_ids)) if inputs_embeds is None else layout.pack(inputs_embeds)
        cos, sin = backbone.rotary_emb(hidden, positions[None])
        return hidden, (cos[0], sin[0])

    def project_query_key(self, attention: nn.Module, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens, heads, head_dim) queries and keys before the rotation; Qwen3 normalizes them here."""
        return query, key

    def packed_layer(self, layer: nn.Module, hidden: Tensor, layout: TokenLayout, context: tuple[Tensor, Tensor],
                     prefix: tuple[Tensor, Tensor] | None) -> Tensor:
        attention = layer.self_attn
        head_dim = attention.head_dim
        normed = layer.input_layernorm(hidden)
        query = attention.q_proj(normed).view(normed.shape[0], -1, head_dim)
        key = attention.k_proj(normed).view(normed.shape[0], -1, head_dim)
        value = attention.v_proj(normed).view(normed.shape[0], -1, head_dim)
        query, key = self.project_query_key(attention, query, key)
        cos, sin = context
        query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=1)
        dropout_p = attention.attention_dropout if attention.training else 0.0
        attended = sentence_attention(query, key, value, layout, attention.scaling, dropout_p, causal=True, prefix=prefix)
        hidden = hidden + attention.o_proj(attended)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def packed_final(self, backbone: PreTrainedModel, hidden: Tensor) -> Tensor:
        return backbone.norm(hidden)


class Qwen3Family(LlamaFamily):
    """Qwen3: RMSNorm over each head's query and key before the rotation."""

    name = "qwen3"

    def project_query_key(self, attention: nn.Module, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        return attention.q_norm(query), attention.k_norm(key)
