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
    ],
)
def test_poolers_on_fixed_inputs(pooler, expected):
    assert torch.allclose(pool(pooler, OUTPUTS, MASK), torch.tensor(expected))


def test_avg_first_last_can_use_embedding_output():
    # index 0 = embedding output (SimCSE's first release): (layer0 + layer2) / 2
    assert torch.allclose(pool("avg_first_last", OUTPUTS, MASK, first_hidden_index=0),
                          torch.tensor([[3.5, 1.5], [2.0, 0.5]]))


def test_mask_pooler_takes_the_mask_position_and_requires_one_per_row():
    ids = torch.tensor([[5, 9, 6], [9, 5, 0]])
    assert torch.equal(pool("mask", OUTPUTS, MASK, ids, mask_token_id=9), torch.tensor([[4.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="exactly one mask"):
        pool("mask", OUTPUTS, MASK, torch.tensor([[9, 9, 6], [9, 5, 0]]), mask_token_id=9)


def test_unknown_pooler_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown pooler 'max'"):
        pool("max", OUTPUTS, MASK)


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
