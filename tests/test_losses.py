import math

import torch

from lightning_sentemb.losses.info_nce import InfoNCELoss, info_nce
from lightning_sentemb.losses.mlm import mask_tokens


def hand_info_nce(anchors, candidates, labels, temperature, bias=None):
    total = 0.0
    for i in range(len(anchors)):
        logits = []
        for j in range(len(candidates)):
            a, c = anchors[i], candidates[j]
            norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in c))
            cos = sum(x * y for x, y in zip(a, c, strict=True)) / norms
            logits.append(cos / temperature + (bias[i][j] if bias else 0.0))
        total += -(logits[labels[i]] - math.log(sum(math.exp(v) for v in logits)))
    return total / len(anchors)


ANCHORS = [[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]
POSITIVES = [[0.9, 0.1], [0.2, 1.0], [1.0, 0.8]]
HARD = [[-1.0, 0.2], [1.0, -0.3], [0.5, -1.0]]


def test_info_nce_matches_hand_computation():
    loss = info_nce(torch.tensor(ANCHORS), torch.tensor(POSITIVES), torch.tensor([0, 1, 2]), 0.05)
    assert math.isclose(loss.item(), hand_info_nce(ANCHORS, POSITIVES, [0, 1, 2], 0.05), rel_tol=1e-5)


def test_supervised_hard_negative_weight_biases_only_own_hard_negative():
    weight = 1.5
    loss_fn = InfoNCELoss(temperature=0.1, hard_negative_weight=weight)
    loss = loss_fn(torch.tensor(ANCHORS), torch.tensor(POSITIVES), torch.tensor([0, 1, 2]), torch.tensor(HARD))
    bias = [[0.0] * 6 for _ in range(3)]
    for i in range(3):
        bias[i][3 + i] = weight
    expected = hand_info_nce(ANCHORS, POSITIVES + HARD, [0, 1, 2], 0.1, bias)
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)
    unweighted = InfoNCELoss(temperature=0.1)(torch.tensor(ANCHORS), torch.tensor(POSITIVES), torch.tensor([0, 1, 2]),
                                               torch.tensor(HARD))
    assert math.isclose(unweighted.item(), hand_info_nce(ANCHORS, POSITIVES + HARD, [0, 1, 2], 0.1), rel_tol=1e-5)
    assert loss.item() > unweighted.item()


def test_mask_tokens_never_touches_special_or_padding(tiny_bert):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    batch = tokenizer(["a man is playing a guitar on the stage tonight"] * 2000 + ["short"], padding=True,
                      return_tensors="pt")
    ids, labels = mask_tokens(batch["input_ids"], batch["attention_mask"], tokenizer, 0.15,
                              torch.Generator().manual_seed(0))
    special = torch.isin(batch["input_ids"], torch.tensor(tokenizer.all_special_ids))
    assert (labels[special] == -100).all()
    assert torch.equal(ids[special], batch["input_ids"][special])
    chosen = labels != -100
    assert torch.equal(labels[chosen], batch["input_ids"][chosen])
    rate = chosen.sum().item() / (~special).sum().item()
    assert 0.14 < rate < 0.16
    masked = (ids[chosen] == tokenizer.mask_token_id).float().mean().item()
    kept = (ids[chosen] == batch["input_ids"][chosen]).float().mean().item()
    assert 0.78 < masked < 0.82 and 0.08 < kept < 0.12
