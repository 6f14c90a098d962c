"""A prefix's attention equals a hand-written attention over [prefix; keys], packed and padded: a decoder
(rotary positions shifted by the prefix, causal within the sentence) and DistilBERT (an encoder without a
key/value cache). DCPCSE and ClusterNS's prefix variant run on these layers on every backbone family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from lightning_sentemb.encoders.packed import SENTEMB_ATTENTION, TokenLayout
from lightning_sentemb.encoders.prefix import PrefixedBackbone


def prefixed_for_test(model, prefix_len: int, padding_free: bool) -> tuple[PrefixedBackbone, torch.Tensor, ...]:
    """A prefixed backbone with a random prefix (no dropout), a padded batch, and the batch's layout when
    the forward runs packed (else None)."""
    prefixed = PrefixedBackbone(model, prefix_len, dropout=0.0).eval()
    assert model.config._attn_implementation == SENTEMB_ATTENTION
    torch.manual_seed(0)
    with torch.no_grad():
        prefixed.prefix_encoder.embedding.weight.normal_()
    input_ids = torch.tensor([[101, 2023, 2003, 1037, 7953, 102], [101, 4937, 102, 0, 0, 0]])
    mask = (input_ids != 0).long()
    return prefixed, input_ids, mask, TokenLayout.from_mask(mask) if padding_free else None


@pytest.mark.parametrize("padding_free", [False, True])
def test_distilbert_prefix_attention_equals_hand_written_attention(padding_free: bool, tiny_distilbert: str) -> None:
    """DCPCSE on an encoder without a key/value cache: the first layer of a prefixed DistilBERT by hand,
    keys and values [prefix; sentence], every prefix key visible, padding keys hidden."""
    model = AutoModel.from_pretrained(tiny_distilbert).eval()
    prefix_len = 3
    prefixed, input_ids, mask, layout = prefixed_for_test(model, prefix_len, padding_free)
    with torch.no_grad():
        ours = prefixed(input_ids, mask, output_hidden_states=True, layout=layout).hidden_states[1]
        prefix_key, prefix_value = prefixed.prefix_encoder(2)[0]  # (batch, heads, prefix_len, head_dim)
        layer, heads = model.transformer.layer[0], model.config.n_heads
        head_dim = model.config.dim // heads
        positions = torch.arange(6) + prefix_len  # shifted: the sentence is numbered after the prefix
        x = model.embeddings.LayerNorm(model.embeddings.word_embeddings(input_ids)
                                       + model.embeddings.position_embeddings(positions)[None])
        attention = layer.attention
        q, k, v = (linear(x).view(2, 6, heads, head_dim).transpose(1, 2)
                   for linear in (attention.q_lin, attention.k_lin, attention.v_lin))
        keys, values = torch.cat([prefix_key, k], dim=2), torch.cat([prefix_value, v], dim=2)
        scores = q @ keys.transpose(-1, -2) / head_dim**0.5  # (batch, heads, 6, prefix + 6)
        visible = torch.cat([torch.ones(2, prefix_len, dtype=torch.bool), mask.bool()], dim=1)[:, None, None, :]
        context = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values
        attended = layer.sa_layer_norm(attention.out_lin(context.transpose(1, 2).reshape(2, 6, -1)) + x)
        hidden = layer.output_layer_norm(layer.ffn(attended) + attended)
    real = mask.bool()
    torch.testing.assert_close(ours[real], hidden[real], atol=1e-5, rtol=1e-5)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("backbone", ["tiny_llama", "tiny_qwen2"])
def test_decoder_prefix_attention_equals_hand_written_attention(backbone: str, padding_free: bool, request) -> None:
    """The first layer of a prefixed decoder, by hand: rotary queries/keys at positions shifted by the
    prefix, keys [prefix; sentence], every prefix key visible, causal within the sentence."""
    path = request.getfixturevalue(backbone)
    model = AutoModel.from_pretrained(path).eval()
    prefix_len = 3
    prefixed, input_ids, mask, layout = prefixed_for_test(model, prefix_len, padding_free)
    with torch.no_grad():
        ours = prefixed(input_ids, mask, output_hidden_states=True, layout=layout).hidden_states[1]
        prefix_key, prefix_value = prefixed.prefix_encoder(2)[0]  # (batch, kv_heads, prefix_len, head_dim)
        layer, config = model.layers[0], model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = config.hidden_size // heads
        x = model.embed_tokens(input_ids)
        h = layer.input_layernorm(x)
        attention = layer.self_attn
        q = attention.q_proj(h).view(2, 6, heads, head_dim).transpose(1, 2)
        k = attention.k_proj(h).view(2, 6, kv_heads, head_dim).transpose(1, 2)
        v = attention.v_proj(h).view(2, 6, kv_heads, head_dim).transpose(1, 2)
        positions = (torch.arange(6) + prefix_len).float()
        inverse = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.cat([positions[:, None] * inverse, positions[:, None] * inverse], dim=-1)
        q = q * angles.cos() + rotate_half(q) * angles.sin()
        k = k * angles.cos() + rotate_half(k) * angles.sin()
        keys = torch.cat([prefix_key, k], dim=2).repeat_interleave(heads // kv_heads, dim=1)
        values = torch.cat([prefix_value, v], dim=2).repeat_interleave(heads // kv_heads, dim=1)
        scores = q @ keys.transpose(-1, -2) / head_dim**0.5  # (batch, heads, 6, prefix + 6)
        visible = torch.ones(2, 1, 6, prefix_len + 6, dtype=torch.bool)
        visible[..., prefix_len:] = torch.tril(torch.ones(6, 6, dtype=torch.bool)) & mask.bool()[:, None, None, :]
        context = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values
        hidden = x + attention.o_proj(context.transpose(1, 2).reshape(2, 6, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    real = mask.bool()
    torch.testing.assert_close(ours[real], hidden[real], atol=1e-5, rtol=1e-5)
