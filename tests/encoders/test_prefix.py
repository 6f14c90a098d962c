"""Deep prefix prompts on tiny random BERT / RoBERTa encoders (no network)."""

import pytest
import torch
from transformers import BertConfig, BertModel, PreTrainedModel, RobertaConfig, RobertaModel

from lightning_sentemb.encoders.prefix import PrefixedBackbone, PrefixEncoder, prefix_parameter_count

HIDDEN, LAYERS, HEADS, VOCAB, MAX_POSITIONS = 32, 2, 4, 100, 64
BACKBONES = [("bert", "sdpa"), ("bert", "eager"), ("roberta", "sdpa"), ("roberta", "eager")]


def make_backbone(family: str, attn: str = "sdpa") -> PreTrainedModel:
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=64,
        max_position_embeddings=MAX_POSITIONS,
        attn_implementation=attn,
    )
    if family == "bert":
        return BertModel(BertConfig(**sizes))
    return RobertaModel(RobertaConfig(pad_token_id=1, bos_token_id=0, eos_token_id=2, **sizes))


def padded_batch(backbone: PreTrainedModel, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random non-special token ids, right-padded with the model's pad id as tokenizers do."""
    generator = torch.Generator().manual_seed(1)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), backbone.config.pad_token_id)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(3, VOCAB, (length,), generator=generator)
        attention_mask[row, :length] = 1
    return input_ids, attention_mask


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


@pytest.mark.parametrize("position_offset", ["shifted", "zero"])
@pytest.mark.parametrize("family,attn", BACKBONES)
def test_zero_length_prefix_reproduces_plain_backbone(family: str, attn: str, position_offset: str) -> None:
    backbone = make_backbone(family, attn).eval()
    prefixed = PrefixedBackbone(backbone, prefix_len=0, position_offset=position_offset).eval()
    input_ids, attention_mask = padded_batch(backbone, [5, 8, 3])
    with torch.no_grad():
        plain = backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        ours = prefixed(input_ids, attention_mask, output_hidden_states=True)
    # sdpa is bit-exact. Eager multiplies by the cache's contiguous copy of the keys instead of the
    # model's transposed view, which changes the matmul's summation order by a rounding step.
    atol = 0.0 if attn == "sdpa" else 1e-6
    torch.testing.assert_close(ours.last_hidden_state, plain.last_hidden_state, rtol=0, atol=atol)
    assert len(ours.hidden_states) == len(plain.hidden_states) == LAYERS + 1
    for ours_layer, plain_layer in zip(ours.hidden_states, plain.hidden_states, strict=True):
        torch.testing.assert_close(ours_layer, plain_layer, rtol=0, atol=atol)


@pytest.mark.parametrize("family,attn", BACKBONES)
def test_outputs_cover_sentence_tokens_only(family: str, attn: str) -> None:
    prefixed = PrefixedBackbone(make_backbone(family, attn), prefix_len=5).eval()
    input_ids, attention_mask = padded_batch(prefixed.backbone, [4, 7])
    with torch.no_grad():
        plain = prefixed.backbone(input_ids=input_ids, attention_mask=attention_mask)
        out = prefixed(input_ids, attention_mask, output_hidden_states=True)
    assert out.last_hidden_state.shape == (2, 7, HIDDEN)
    assert all(hidden.shape == (2, 7, HIDDEN) for hidden in out.hidden_states)
    assert out.past_key_values is None
    assert not torch.allclose(out.last_hidden_state, plain.last_hidden_state)


@pytest.mark.parametrize("family,attn", BACKBONES)
def test_repeated_forwards_use_a_fresh_cache(family: str, attn: str) -> None:
    prefixed = PrefixedBackbone(make_backbone(family, attn), prefix_len=3).eval()
    input_ids, attention_mask = padded_batch(prefixed.backbone, [4, 6])
    with torch.no_grad():
        first = prefixed(input_ids, attention_mask).last_hidden_state
        prefixed(*padded_batch(prefixed.backbone, [2, 5, 3]))  # other batch size and length in between
        second = prefixed(input_ids, attention_mask).last_hidden_state
    assert torch.equal(first, second)


@pytest.mark.parametrize("projection", [False, True])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_gradients_reach_every_layer_prefix(family: str, projection: bool, monkeypatch) -> None:
    prefixed = PrefixedBackbone(
        make_backbone(family), prefix_len=4, projection=projection, projection_hidden_size=16
    )
    prefixed.train()
    encoder = prefixed.prefix_encoder
    produced: list[tuple[torch.Tensor, torch.Tensor]] = []
    original_forward = encoder.forward

    def recording_forward(batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = original_forward(batch_size)
        for key, value in pairs:
            key.retain_grad()
            value.retain_grad()
        produced.extend(pairs)
        return pairs

    monkeypatch.setattr(encoder, "forward", recording_forward)
    input_ids, attention_mask = padded_batch(prefixed.backbone, [5, 3])
    out = prefixed(input_ids, attention_mask)
    # A random readout: summing LayerNorm outputs directly is constant at init and has no gradient.
    readout = torch.randn(out.last_hidden_state.shape, generator=torch.Generator().manual_seed(2))
    (out.last_hidden_state * readout).sum().backward()

    assert len(produced) == LAYERS
    for key, value in produced:
        assert key.shape == value.shape == (2, HEADS, 4, HIDDEN // HEADS)
        assert key.grad is not None and key.grad.abs().sum() > 0
        assert value.grad is not None and value.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.parameters())
    assert all(p.grad is None for p in prefixed.backbone.parameters())


def test_frozen_backbone_is_bit_identical_after_an_optimizer_step() -> None:
    prefixed = PrefixedBackbone(make_backbone("bert"), prefix_len=4)
    prefixed.train()
    assert prefixed.backbone.training, "the backbone must stay in train mode (dropout is the augmentation)"
    trainable = [p for p in prefixed.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in prefixed.prefix_encoder.parameters()}
    backbone_before = {name: t.clone() for name, t in prefixed.backbone.state_dict().items()}
    prefix_before = prefixed.prefix_encoder.embedding.weight.detach().clone()

    optimizer = torch.optim.AdamW(trainable, lr=0.1, weight_decay=0.01)
    input_ids, attention_mask = padded_batch(prefixed.backbone, [6, 4])
    out = prefixed(input_ids, attention_mask)
    readout = torch.randn(out.last_hidden_state.shape, generator=torch.Generator().manual_seed(3))
    (out.last_hidden_state * readout).sum().backward()
    optimizer.step()

    for name, tensor in prefixed.backbone.state_dict().items():
        assert torch.equal(tensor, backbone_before[name]), name
    assert not torch.equal(prefixed.prefix_encoder.embedding.weight, prefix_before)


@pytest.mark.parametrize("position_offset", ["shifted", "zero"])
@pytest.mark.parametrize("family,attn", BACKBONES)
def test_padding_does_not_change_sentence_embeddings(family: str, attn: str, position_offset: str) -> None:
    backbone = make_backbone(family, attn)
    prefixed = PrefixedBackbone(backbone, prefix_len=4, position_offset=position_offset).eval()
    input_ids, attention_mask = padded_batch(prefixed.backbone, [4, 9])
    short_ids, short_mask = input_ids[:1, :4], attention_mask[:1, :4]
    with torch.no_grad():
        batched = prefixed(input_ids, attention_mask).last_hidden_state
        alone = prefixed(short_ids, short_mask).last_hidden_state
    torch.testing.assert_close(batched[:1, 0], alone[:, 0], rtol=0, atol=1e-5)  # [CLS] / <s>
    torch.testing.assert_close(
        mean_pool(batched[:1], attention_mask[:1]), mean_pool(alone, short_mask), rtol=0, atol=1e-5
    )


# Hand-derived, prefix_len 3, rows of 4 and 6 tokens padded to 6. BERT numbers every slot from the
# first position; RoBERTa (padding_idx 1) numbers real tokens from padding_idx + 1 and gives pads
# padding_idx.
EXPECTED_POSITIONS = {
    ("bert", "shifted"): [[3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]],
    ("bert", "zero"): [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]],
    ("roberta", "shifted"): [[5, 6, 7, 8, 1, 1], [5, 6, 7, 8, 9, 10]],
    ("roberta", "zero"): [[2, 3, 4, 5, 1, 1], [2, 3, 4, 5, 6, 7]],
}


@pytest.mark.parametrize("family,position_offset", list(EXPECTED_POSITIONS))
def test_position_ids(family: str, position_offset: str) -> None:
    prefixed = PrefixedBackbone(make_backbone(family), prefix_len=3, position_offset=position_offset).eval()
    seen: list[torch.Tensor] = []
    hook = prefixed.backbone.embeddings.position_embeddings.register_forward_hook(
        lambda module, args, output: seen.append(args[0])
    )
    with torch.no_grad():
        prefixed(*padded_batch(prefixed.backbone, [4, 6]))
    hook.remove()
    assert len(seen) == 1
    expected = torch.tensor(EXPECTED_POSITIONS[(family, position_offset)])
    assert torch.equal(seen[0].expand_as(expected), expected)


@pytest.mark.parametrize(
    "family,position_offset,expected",
    [("bert", "shifted", 61), ("bert", "zero", 64), ("roberta", "shifted", 59), ("roberta", "zero", 62)],
)
def test_max_sentence_length(family: str, position_offset: str, expected: int) -> None:
    prefixed = PrefixedBackbone(make_backbone(family), prefix_len=3, position_offset=position_offset).eval()
    assert prefixed.max_sentence_length == expected
    with torch.no_grad():
        prefixed(*padded_batch(prefixed.backbone, [expected]))
    with pytest.raises(ValueError, match="max_sentence_length"):
        prefixed(*padded_batch(prefixed.backbone, [expected + 1]))


def test_prefix_encoder_layout_dropout_and_config() -> None:
    config = make_backbone("bert").config
    encoder = PrefixEncoder.from_config(config, prefix_len=5)
    assert encoder.dropout.p == config.hidden_dropout_prob

    encoder.eval()
    pairs = encoder(batch_size=3)
    weight = encoder.embedding.weight.view(5, LAYERS, 2, HEADS, HIDDEN // HEADS)  # reference row layout
    for layer, (key, value) in enumerate(pairs):
        assert torch.equal(key[1], weight[:, layer, 0].transpose(0, 1))
        assert torch.equal(value[2], weight[:, layer, 1].transpose(0, 1))

    encoder.train()
    key = encoder(batch_size=2)[0][0]
    assert not torch.equal(key[0], key[1]), "each example draws its own prefix dropout mask"


def test_prefix_encoder_initialization_follows_config() -> None:
    config = BertConfig(initializer_range=0.02)
    encoder = PrefixEncoder.from_config(config, prefix_len=16, projection=True)
    assert abs(encoder.embedding.weight.std().item() - 0.02) < 0.002
    assert abs(encoder.trans[2].weight.std().item() - 0.02) < 0.002
    assert torch.equal(encoder.trans[0].bias, torch.zeros_like(encoder.trans[0].bias))


@pytest.mark.parametrize("projection", [False, True])
def test_parameter_count_formula_matches_module(projection: bool) -> None:
    config = make_backbone("roberta").config
    encoder = PrefixEncoder.from_config(config, 7, projection=projection, projection_hidden_size=24)
    actual = sum(p.numel() for p in encoder.parameters())
    assert prefix_parameter_count(config, 7, projection, projection_hidden_size=24) == actual


def test_bert_base_trainable_fraction() -> None:
    config = BertConfig()  # bert-base: 12 layers, hidden 768, 12 heads, vocab 30522
    with torch.device("meta"):
        backbone = BertModel(config, add_pooling_layer=False)  # as the DCPCSE reference builds it
        plain = PrefixedBackbone(backbone, prefix_len=16)
        projected = PrefixedBackbone(backbone, prefix_len=16, projection=True)
    backbone_count = sum(p.numel() for p in backbone.parameters())
    assert backbone_count == 108_891_648  # 109,482,240 with BERT's pooler

    projected_by_hand = 16 * 768 + (768 * 512 + 512) + (512 * 12 * 2 * 768 + 12 * 2 * 768)
    cases = [(plain, False, 16 * 12 * 2 * 768), (projected, True, projected_by_hand)]
    for model, projection, by_hand in cases:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert trainable == prefix_parameter_count(config, 16, projection) == by_hand
        print(
            f"bert-base prefix 16 projection={projection}: {trainable:,} trainable of "
            f"{backbone_count + trainable:,} = {trainable / (backbone_count + trainable):.4%} "
            f"({trainable / backbone_count:.4%} of the backbone)"
        )
    assert 16 * 12 * 2 * 768 == 294_912
    assert projected_by_hand == 9_861_632
