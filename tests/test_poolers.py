from types import SimpleNamespace

import pytest
import torch

from lightning_sentemb.encoders.plain import PlainFormat, pool

# batch of 2, 3 tokens, hidden 2; second row has one padding token
LAYERS = [
    torch.tensor([[[1.0, 1.0], [3.0, 3.0], [5.0, 5.0]], [[2.0, 0.0], [4.0, 0.0], [100.0, 100.0]]]),
    torch.tensor([[[0.0, 2.0], [2.0, 2.0], [4.0, 2.0]], [[1.0, 1.0], [1.0, 3.0], [100.0, 100.0]]]),
    torch.tensor([[[2.0, 0.0], [4.0, 0.0], [6.0, 0.0]], [[0.0, 0.0], [2.0, 2.0], [100.0, 100.0]]]),
]
OUTPUTS = SimpleNamespace(last_hidden_state=LAYERS[-1], hidden_states=tuple(LAYERS))
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
FEATURES = {"attention_mask": MASK}


@pytest.mark.parametrize(
    "pooler, expected",
    [
        ("cls", [[2.0, 0.0], [0.0, 0.0]]),
        ("cls_before_pooler", [[2.0, 0.0], [0.0, 0.0]]),
        ("avg", [[4.0, 0.0], [1.0, 1.0]]),
        # (layer1 + layer2) / 2 averaged over real tokens
        ("avg_first_last", [[3.0, 1.0], [1.0, 1.5]]),
        # (layer2 + layer1) / 2 as well here: the top two of three states are layers 1 and 2
        ("avg_top2", [[3.0, 1.0], [1.0, 1.5]]),
        # each row's last real token: position 2, then position 1 (position 2 is padding)
        ("last", [[6.0, 0.0], [2.0, 2.0]]),
    ],
)
def test_poolers_on_fixed_inputs(pooler, expected):
    assert torch.allclose(pool(pooler, OUTPUTS, FEATURES), torch.tensor(expected))


def test_last_pooler_finds_the_last_token_of_left_padded_rows():
    outputs = SimpleNamespace(last_hidden_state=torch.arange(6.0).view(2, 3, 1))
    left = torch.tensor([[1, 1, 1], [0, 1, 1]])
    right = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert pool("last", outputs, {"attention_mask": left}).flatten().tolist() == [2.0, 5.0]
    assert pool("last", outputs, {"attention_mask": right}).flatten().tolist() == [2.0, 4.0]


def test_avg_emb_last_averages_the_embedding_output_with_the_last_layer():
    # hidden_states[0] = the embedding output (SimCSE's first release's first-last): (layer0 + layer2) / 2
    assert torch.allclose(pool("avg_emb_last", OUTPUTS, FEATURES), torch.tensor([[3.5, 1.5], [2.0, 0.5]]))


@pytest.mark.parametrize(("pooler", "first"), [("avg_first_last", 1), ("avg_emb_last", 0), ("avg_top2", -2)])
def test_layer_poolers_equal_a_mean_over_the_backbones_hidden_states(pooler, first, tiny_bert):
    """What `--pooler` / `model.init_args.pooler` selects, through the encoder (packed forward), against
    transformers' own `output_hidden_states` averaged here over the real tokens."""
    from transformers import AutoModel

    from lightning_sentemb.methods import SimCSE, build_method

    method = build_method(SimCSE, tiny_bert, pooler=pooler, mlp="none").eval()
    sentences = ["a man plays a guitar .", "the cat sleeps on the mat all day long"]
    batch = method.encoder.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = AutoModel.from_pretrained(tiny_bert).eval()(**batch, output_hidden_states=True).hidden_states
    mask = batch["attention_mask"].unsqueeze(-1).float()
    want = (((states[first] + states[-1]) / 2) * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(method.encode(sentences), want, atol=1e-5, rtol=1e-5)


def test_mask_pooler_takes_the_position_the_template_format_gives():
    features = {"attention_mask": MASK, "pool_position": torch.tensor([1, 0])}
    assert torch.equal(pool("mask", OUTPUTS, features), torch.tensor([[4.0, 0.0], [0.0, 0.0]]))


def test_unknown_pooler_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown pooler 'max'"):
        pool("max", OUTPUTS, FEATURES)


def test_plain_format_truncates_sentence_and_keeps_special_tokens(tiny_bert, tiny_roberta):
    from transformers import AutoTokenizer

    bert = PlainFormat(AutoTokenizer.from_pretrained(tiny_bert))
    ids = bert.sentence_ids(["a man is playing a guitar", "hi"])
    batch = bert.build(ids, max_length=5)
    cls, sep = bert.tokenizer.cls_token_id, bert.tokenizer.sep_token_id
    assert batch["input_ids"][0].tolist() == [cls, *ids[0][:3], sep]
    assert batch["input_ids"][1].tolist() == [cls, *ids[1], sep, 0, 0][:5]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    roberta = PlainFormat(AutoTokenizer.from_pretrained(tiny_roberta))
    row = roberta.build(roberta.sentence_ids(["the cat sat"]), None)["input_ids"][0].tolist()
    assert row[0] == 0 and row[-1] == 2 and roberta.num_special_tokens == 2
