"""MNTP (LLM2Vec's masked next-token prediction) against a hand-written loss in the reference's terms
(McGill-NLP/llm2vec experiments/run_mntp.py: masked-LM labels, -100 elsewhere, scored by the causal LM's
shifted cross-entropy on the bidirectional model): value and every LoRA gradient on a tiny decoder."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sentemb.backbones import UnsupportedBackbone
from lightning_sentemb.encoders.packed import set_attention
from lightning_sentemb.methods import MNTP
from lightning_sentemb.methods.building import build_method

SENTENCES = ["a man is playing a guitar on the stage tonight .", "the cat sat on the mat .",
             "this sentence means something rather long , really .", "two dogs run across the field today ."]
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


def quiet(method: nn.Module) -> nn.Module:
    for module in method.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return method.train()


def batch_of(method: MNTP) -> dict:
    ids = method.encoder.format.sentence_ids(SENTENCES)
    method.collate_generator.manual_seed(3)
    return method.collate([{"sent0": row} for row in ids])


def hand_written_loss(method: MNTP, batch: dict) -> torch.Tensor:
    """Eager attention under a padding-only 4D mask (bidirectional, by hand), the causal LM's head, and
    for each masked token i of each row: -log p(token i | output at i - 1), averaged."""
    model = method.encoder.mlm_model
    model.config.is_causal = True  # nothing of ours: the mask alone makes it bidirectional
    set_attention(model.base_model, "eager")
    features = batch["features"]
    real = features["attention_mask"].bool()
    mask = torch.zeros(real.shape[0], 1, real.shape[1], real.shape[1]).masked_fill(~real[:, None, None, :], -1e30)
    positions = (features["attention_mask"].cumsum(1) - 1).clamp_min(0)
    logits = model(input_ids=features["input_ids"], attention_mask=mask, position_ids=positions).logits
    terms = []
    for row, labels in enumerate(batch["labels"].tolist()):
        for i, label in enumerate(labels):
            if label != -100 and i > 0:
                terms.append(-F.log_softmax(logits[row, i - 1], dim=-1)[label])
    return torch.stack(terms).mean()


def grads(method: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    loss.backward()
    return {n: p.grad.clone() for n, p in method.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padding_free", [True, False])
def test_mntp_equals_hand_written_llm2vec_loss(tiny_qwen2: str, padding_free: bool) -> None:
    torch.manual_seed(0)
    method = quiet(build_method(MNTP, tiny_qwen2, lora=LORA, attn_implementation=None if padding_free else "padded"))
    assert method.encoder.bidirectional and method.encoder.padding_free == padding_free
    for name, parameter in method.named_parameters():  # LoRA B starts at zero: give the adapters a say
        if "lora_B" in name:
            nn.init.normal_(parameter, std=0.1)
    batch = batch_of(method)
    labels = batch["labels"]
    assert (labels != -100).sum() >= 6 and not bool(batch["features"]["attention_mask"].all())
    reference = copy.deepcopy(method)
    loss, _ = method.training_loss(batch)
    expected = hand_written_loss(reference, batch)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    got, want = grads(method, loss), grads(reference, expected)
    assert got.keys() == want.keys() and got and all("lora_" in name for name in got)
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_mntp_corruption(tiny_qwen2: str) -> None:
    """Labels only at sentence tokens (never BOS/EOS/padding), the rest -100; of the chosen, about 80% the
    mask token; `mask_replace: all` masks every one."""
    method = build_method(MNTP, tiny_qwen2, mask_probability=0.5)
    ids = method.encoder.format.sentence_ids(SENTENCES * 10)
    method.collate_generator.manual_seed(0)
    batch = method.collate([{"sent0": row} for row in ids])
    original = method.encoder.format.build(ids, None)["input_ids"]
    chosen = batch["labels"] != -100
    torch.testing.assert_close(batch["labels"][chosen], original[chosen])
    specials = torch.isin(original, torch.tensor(method.tokenizer.all_special_ids))
    assert not bool((chosen & (specials | ~batch["features"]["attention_mask"].bool())).any())
    masked = batch["features"]["input_ids"][chosen] == method.tokenizer.mask_token_id
    assert 0.4 < chosen.sum() / (~specials & batch["features"]["attention_mask"].bool()).sum() < 0.6
    assert 0.7 < masked.float().mean() < 0.9
    method.hparams.mask_replace = "all"
    method._collator = None
    every = method.collate([{"sent0": row} for row in ids])
    assert bool((every["features"]["input_ids"][every["labels"] != -100] == method.tokenizer.mask_token_id).all())


def test_mntp_blank_mask_token_without_a_mask_token(tiny_opt: str) -> None:
    """A tokenizer without a mask token (byte-level BPE) gets "_", the reference's blank."""
    method = build_method(MNTP, tiny_opt, mask_replace="all", mask_probability=0.5)
    assert method.tokenizer.mask_token_id is None
    ids = method.encoder.format.sentence_ids(["the quick brown fox jumps over the lazy dog"] * 4)
    batch = method.collate([{"sent0": row} for row in ids])
    chosen = batch["labels"] != -100
    assert bool(chosen.any())
    assert bool((batch["features"]["input_ids"][chosen] == method.tokenizer.convert_tokens_to_ids("_")).all())


def test_mntp_refused_on_encoders(tiny_bert: str) -> None:
    with pytest.raises(UnsupportedBackbone, match="encoder"):
        build_method(MNTP, tiny_bert)
