"""MNTP (LLM2Vec's masked next-token prediction) against a hand-written loss in the reference's terms
(McGill-NLP/llm2vec experiments/run_mntp.py: masked-LM labels, -100 elsewhere, scored by the causal LM's
shifted cross-entropy over full-vocabulary logits at every position, on the bidirectional model): value
and every gradient on a tiny decoder, in float64, with LoRA and in full fine-tuning of a tied head."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2Config

from lightning_sentemb.backbones import UnsupportedBackbone
from lightning_sentemb.encoders.packed import set_attention
from lightning_sentemb.methods import MNTP
from lightning_sentemb.methods.building import build_method
from tests.conftest import DECODER_SIZES, minilm_ids, save_tiny
from tests.sync_counting import StepCounter

SENTENCES = ["a man is playing a guitar on the stage tonight .", "the cat sat on the mat .",
             "this sentence means something rather long , really .", "two dogs run across the field today ."]
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def tied_qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny_qwen2 with its LM head tied to the input embeddings, as Qwen2-0.5B's."""
    config = Qwen2Config(**DECODER_SIZES, **minilm_ids(), tie_word_embeddings=True)
    return save_tiny(tmp_path_factory.mktemp("tied_qwen2"), config)


def quiet(method: nn.Module) -> nn.Module:
    for module in method.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return method.train()


def batch_of(method: MNTP) -> dict:
    ids = method.encoder.format.sentence_ids(SENTENCES)
    method.collate_generator.manual_seed(3)
    return method.collate([{"sent0": row} for row in ids])


def labels_of(batch: dict) -> torch.Tensor:
    """The batch's masked-LM labels as the reference's collator gives them: (batch, width), -100 where no
    token is predicted; the state at i - 1 predicts token i."""
    input_ids, predicted = batch["features"]["input_ids"], batch["predicted"]
    labels = torch.full((input_ids.numel(),), -100)
    labels[predicted.index + 1] = predicted.labels
    return labels.view_as(input_ids)


def hand_written_loss(method: MNTP, batch: dict) -> torch.Tensor:
    """Eager attention under a padding-only 4D mask (bidirectional, by hand), the causal LM's head on every
    position, and for each masked token i of each row: -log p(token i | output at i - 1), averaged."""
    model = method.encoder.mlm_model
    model.config.is_causal = True  # nothing of ours: the mask alone makes it bidirectional
    set_attention(model.base_model, "eager")
    features = batch["features"]
    real = features["attention_mask"].bool()
    mask = torch.zeros(real.shape[0], 1, real.shape[1], real.shape[1], dtype=model.dtype)
    mask = mask.masked_fill(~real[:, None, None, :], -1e30)
    positions = (features["attention_mask"].cumsum(1) - 1).clamp_min(0)
    logits = model(input_ids=features["input_ids"], attention_mask=mask, position_ids=positions).logits
    rows, before, tokens = [], [], []
    for row, labels in enumerate(labels_of(batch).tolist()):
        for i, label in enumerate(labels):
            if label != -100 and i > 0:
                rows, before, tokens = rows + [row], before + [i - 1], tokens + [label]
    return -F.log_softmax(logits[rows, before], dim=-1)[range(len(tokens)), tokens].mean()


def grads(method: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    loss.backward()
    return {n: p.grad.clone() for n, p in method.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("training", ["lora", "full, tied head"])
@pytest.mark.parametrize("padding_free", [True, False])
def test_mntp_equals_hand_written_llm2vec_loss(tiny_qwen2: str, tied_qwen2: str, padding_free: bool,
                                               training: str) -> None:
    """In float64 to 1e-6, padded and padding-free: the loss and gradients of the head run on the predicting
    states alone equal the full-vocabulary computation at every position; the head sees only those states.
    With LoRA only the adapters train; in full fine-tuning a tied head trains the input embeddings it is
    (and an AdamW step changes them)."""
    torch.manual_seed(0)
    lora = LORA if training == "lora" else None
    backbone = tiny_qwen2 if training == "lora" else tied_qwen2
    method = quiet(build_method(MNTP, backbone, lora=lora, attn_implementation=None if padding_free else "padded"))
    method = method.double()
    assert method.encoder.bidirectional and method.encoder.padding_free == padding_free
    for name, parameter in method.named_parameters():  # LoRA B starts at zero: give the adapters a say
        if "lora_B" in name:
            nn.init.normal_(parameter, std=0.1)
    batch = batch_of(method)
    predicted, mask = batch["predicted"], batch["features"]["attention_mask"]
    assert predicted.count >= 6 and not bool(mask.all())
    reference = copy.deepcopy(method)
    head_rows = []
    head = method.encoder.mlm_model.get_output_embeddings()
    head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[0]))
    loss, _ = method.training_loss(batch)
    assert head_rows == [predicted.count] and predicted.count < mask.sum() / 2
    expected = hand_written_loss(reference, batch)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    got, want = grads(method, loss), grads(reference, expected)
    assert got.keys() == want.keys() and got
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-6, msg=name)
    embeddings = method.encoder.backbone.get_input_embeddings().weight
    if training == "lora":
        assert all("lora_" in name for name in got)
        return
    assert head.weight is embeddings and "encoder.mlm_model.model.embed_tokens.weight" in got
    before = embeddings.detach().clone()
    torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=1e-3).step()
    assert not torch.equal(embeddings, before)


def test_untied_head_stays_frozen_in_full_fine_tuning(tiny_qwen2: str) -> None:
    """The reference drops its untied head when saving: only the backbone's change carries over."""
    method = build_method(MNTP, tiny_qwen2)
    head = method.encoder.mlm_model.get_output_embeddings()
    assert head.weight is not method.encoder.backbone.get_input_embeddings().weight
    assert not head.weight.requires_grad and method.encoder.backbone.get_input_embeddings().weight.requires_grad


def test_mntp_step_reads_nothing_back(tiny_qwen2: str) -> None:
    """The predicting states come from the collator and their count from the host: MNTP's loss and backward
    read nothing back from the device, padding-free; padded, only transformers' mask preparation reads (the
    counter sees reads)."""
    progress = SimpleNamespace(total=SimpleNamespace(ready=1))
    trainer = SimpleNamespace(sanity_checking=False, validating=False,
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    owners = {}
    for attention in (None, "padded"):
        method = build_method(MNTP, tiny_qwen2, attn_implementation=attention).train()
        batch = batch_of(method)
        counter = StepCounter()
        counter.trainer = trainer  # what it reads of a fit: the step
        with counter.counting_host_syncs():
            loss, _ = method.training_loss(batch)
            loss.backward()
        owners[attention] = {record.owner for record in counter.records}
    assert owners[None] == set() and owners["padded"] == {"transformers"}


def test_mntp_corruption(tiny_qwen2: str) -> None:
    """Labels only at sentence tokens (never BOS/EOS/padding), the rest -100; of the chosen, about 80% the
    mask token; `mask_replace: all` masks every one."""
    method = build_method(MNTP, tiny_qwen2, mask_probability=0.5)
    ids = method.encoder.format.sentence_ids(SENTENCES * 10)
    method.collate_generator.manual_seed(0)
    batch = method.collate([{"sent0": row} for row in ids])
    original = method.encoder.format.build(ids, None)["input_ids"]
    labels = labels_of(batch)
    chosen = labels != -100
    torch.testing.assert_close(labels[chosen], original[chosen])
    specials = torch.isin(original, torch.tensor(method.tokenizer.all_special_ids))
    assert not bool((chosen & (specials | ~batch["features"]["attention_mask"].bool())).any())
    masked = batch["features"]["input_ids"][chosen] == method.tokenizer.mask_token_id
    assert 0.4 < chosen.sum() / (~specials & batch["features"]["attention_mask"].bool()).sum() < 0.6
    assert 0.7 < masked.float().mean() < 0.9
    method.hparams.mask_replace = "all"
    method._collator = None
    every = method.collate([{"sent0": row} for row in ids])
    assert bool((every["features"]["input_ids"][labels_of(every) != -100] == method.tokenizer.mask_token_id).all())


def test_mntp_blank_mask_token_without_a_mask_token(tiny_opt: str) -> None:
    """A tokenizer without a mask token (byte-level BPE) gets "_", the reference's blank."""
    method = build_method(MNTP, tiny_opt, mask_replace="all", mask_probability=0.5)
    assert method.tokenizer.mask_token_id is None
    ids = method.encoder.format.sentence_ids(["the quick brown fox jumps over the lazy dog"] * 4)
    batch = method.collate([{"sent0": row} for row in ids])
    chosen = labels_of(batch) != -100
    assert bool(chosen.any())
    assert bool((batch["features"]["input_ids"][chosen] == method.tokenizer.convert_tokens_to_ids("_")).all())


def test_mntp_refused_on_encoders(tiny_bert: str) -> None:
    with pytest.raises(UnsupportedBackbone, match="encoder"):
        build_method(MNTP, tiny_bert)
