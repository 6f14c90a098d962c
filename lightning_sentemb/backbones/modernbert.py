"""ModernBERT: rotary positions, pre-norm layers, global attention every few layers and a bidirectional
sliding window in the others, a final norm.

transformers' ModernBERT unpads only under FlashAttention; its SDPA/eager path (the one on CPU and
without flash-attn) runs padded. The packed forward here is exact against that padded path, local
windows included, and is also how ModernBERT takes a DCPCSE prefix: its attention has no key/value
cache to hand one to, so the prefix keys/values join each layer's keys here (visible to every token,
in global and local layers alike) and DCPCSE on ModernBERT always runs packed.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.models.modernbert.modeling_modernbert import apply_rotary_pos_emb

from ..encoders.packed import TokenLayout, sentence_attention
from .family import BackboneFamily


class ModernBertFamily(BackboneFamily):
    name = "modernbert"
    dropout_keys = ("attention_dropout", "embedding_dropout", "mlp_dropout")

    def packed_refusal(self) -> str | None:
        return None

    def mlm_logits(self, mlm_model: PreTrainedModel, hidden: Tensor) -> Tensor:
        """ModernBertForMaskedLM's head: prediction head, then the (tied) decoder."""
        return mlm_model.decoder(mlm_model.head(hidden))

    def layers(self, backbone: PreTrainedModel) -> Sequence[nn.Module]:
        return backbone.layers

    def packed_embed(self, backbone: PreTrainedModel, layout: TokenLayout, input_ids: Tensor | None,
                     inputs_embeds: Tensor | None, positions: Tensor) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
        """ModernBertEmbeddings (tokens or given embeddings, norm, dropout) and the rotary cos/sin of
        each attention type (global and local layers use different bases)."""
        embeddings = backbone.embeddings
        words = embeddings.tok_embeddings(layout.pack(input_ids)) if inputs_embeds is None else layout.pack(inputs_embeds)
        hidden = embeddings.drop(embeddings.norm(words))
        rotary = {kind: backbone.rotary_emb(hidden, positions[None], kind) for kind in set(backbone.config.layer_types)}
        return hidden, rotary

    def packed_layer(self, layer: nn.Module, hidden: Tensor, layout: TokenLayout,
                     context: dict[str, tuple[Tensor, Tensor]], prefix: tuple[Tensor, Tensor] | None) -> Tensor:
        attention = layer.attn
        heads, head_dim = self.config.num_attention_heads, attention.head_dim
        query, key, value = attention.Wqkv(layer.attn_norm(hidden)).view(-1, 3, heads, head_dim).unbind(1)
        cos, sin = context[layer.attention_type]
        # (tokens, heads, d) with cos/sin (1, tokens, d): rotate with heads as the broadcast dimension
        query, key = apply_rotary_pos_emb(query, key, cos[0], sin[0], unsqueeze_dim=1)
        window = self.config.sliding_window if layer.attention_type == "sliding_attention" else None
        dropout_p = attention.attention_dropout if attention.training else 0.0
        attended = sentence_attention(query, key, value, layout, head_dim**-0.5, dropout_p, window=window, prefix=prefix)
        hidden = hidden + attention.out_drop(attention.Wo(attended))
        return hidden + layer.mlp(layer.mlp_norm(hidden))

    def packed_final(self, backbone: PreTrainedModel, hidden: Tensor) -> Tensor:
        return backbone.final_norm(hidden)
