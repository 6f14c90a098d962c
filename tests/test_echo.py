"""Echo embeddings: the second copy's span comes from the ids as built, so pooling covers exactly its
tokens even with a BPE that merges text across a copy's edge (trained here to merge across ': x');
zero-shot through `sentemb evaluate --template echo`, and in training."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerFast

from lightning_sentemb.cli import main
from lightning_sentemb.encoders.echo import ECHO_TEMPLATE
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods import PromptBERT, SimCSE

from .conftest import DECODER_SIZES

WORDS = ["cats", "dogs", "the cat sat", "a dog ran", "birds sing", "cats and dogs"]


def merging_bpe() -> PreTrainedTokenizerFast:
    """Byte-level BPE without the word-splitting regex, trained on echo prompts: its merges run across
    spaces and punctuation, e.g. ': c' + 'ats' into one token."""
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [ECHO_TEMPLATE.replace("[X]", w) for w in WORDS] * 50
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>", model_max_length=128)


@pytest.fixture(scope="module")
def echo_decoder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("echo_llama")
    tokenizer = merging_bpe()
    torch.manual_seed(0)
    LlamaModel(LlamaConfig(**DECODER_SIZES, vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=0,
                           eos_token_id=0)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_echo_span_is_the_second_copy_though_bpe_merges_across_it(echo_decoder: str) -> None:
    method = SimCSE(echo_decoder, template="echo", mlp="none").eval()
    assert method.hparams.pooler == "echo_mean"
    tokenizer, format = method.tokenizer, method.encoder.format
    ids = format.sentence_ids(WORDS)
    whole = tokenizer(ECHO_TEMPLATE.replace("[X]", WORDS[0]), add_special_tokens=False)["input_ids"]
    assert not any(whole[i:i + len(ids[0])] == ids[0] for i in range(len(whole))), "the BPE must merge across"
    features = format.build(ids, None)
    hidden = method.encoder.run_backbone(features).last_hidden_state
    for row, sentence in enumerate(ids):
        span = features["echo_mask"][row].nonzero().squeeze(1).tolist()
        start = len(format.before) + len(sentence) + len(format.between)
        assert span == list(range(start, start + len(sentence)))
        assert features["input_ids"][row, span].tolist() == sentence
        assert features["input_ids"][row, : len(format.before) + len(sentence)].tolist()[-len(sentence):] == sentence
    with torch.no_grad():
        mean = method.encoder(features)
        method.encoder.pooler = "echo_last"
        last = method.encoder(features)
    for row, sentence in enumerate(ids):
        span = features["echo_mask"][row].bool()
        torch.testing.assert_close(mean[row], hidden[row, span].mean(0).detach())
        torch.testing.assert_close(last[row], hidden[row, span.nonzero()[-1, 0]].detach())


def test_echo_zero_shot_through_sentemb_evaluate(echo_decoder: str, sts_fixture: Path, tmp_path: Path) -> None:
    output = tmp_path / "scores.json"
    main(["evaluate", "--model", echo_decoder, "--template", "echo", "--pooler", "echo_mean", "--tasks", "sts",
          "--data-dir", str(sts_fixture), "--output", str(output), "--precision", "32"])
    scores = json.loads(output.read_text())["sts"]
    assert all(-100 <= value <= 100 for value in scores.values())


def test_echo_training_packed_equals_padded(tiny_qwen2: str) -> None:
    """Unsupervised SimCSE and supervised NLI (PromptEOL's recipe) with the echo template and pooler: the
    padding-free forward's loss and gradients equal the padded one's."""
    torch.manual_seed(0)
    packed = SimCSE(tiny_qwen2, template="echo", pooler="echo_last", mlp="none", hard_negative_weight=0.0)
    for module in packed.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    padded = copy.deepcopy(packed)
    padded.encoder.configure_speed(padding_free=False, compile_layers=False)
    ids = packed.encoder.format.sentence_ids(WORDS)
    for examples in ([{"sent0": row} for row in ids],
                     [{"sent0": ids[i], "sent1": ids[(i + 1) % 6], "hard_neg": ids[(i + 2) % 6]} for i in range(6)]):
        batch = packed.collate(examples)
        losses = []
        for method in (packed, padded):
            method.zero_grad(set_to_none=True)
            loss, _ = method.step_loss(copy.deepcopy(batch))
            loss.backward()
            losses.append((loss.detach(), {n: p.grad for n, p in method.named_parameters() if p.grad is not None}))
        torch.testing.assert_close(losses[0][0], losses[1][0], atol=1e-5, rtol=1e-5)
        for name, grad in losses[0][1].items():
            torch.testing.assert_close(grad, losses[1][1][name], atol=1e-5, rtol=1e-5, msg=name)


def test_echo_refusals(tiny_qwen2: str) -> None:
    with pytest.raises(SentEmbUserError, match="template echo"):
        SimCSE(tiny_qwen2, pooler="echo_mean")
    with pytest.raises(SentEmbUserError, match="second copy"):
        SimCSE(tiny_qwen2, template="echo", pooler="last")
    with pytest.raises(SentEmbUserError, match="exactly twice"):
        SimCSE(tiny_qwen2, template="Rewrite: [X]")
    with pytest.raises(SentEmbUserError, match="its own input format"):
        PromptBERT(tiny_qwen2, template="echo")
