"""Echo embeddings: each row is the whole prompt tokenized at once, and the second copy's span its tokens
that hold any of its characters, also with a BPE that merges text across a copy's edge (trained here to
merge across ': x'); zero-shot through `sentemb evaluate --template echo` against a hand-built encoding,
and in training."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import AutoModel, AutoTokenizer, LlamaConfig, LlamaModel, PreTrainedTokenizerFast

from lightning_sentemb.cli import main
from lightning_sentemb.data.senteval import load_sts_task
from lightning_sentemb.encoders.echo import ECHO_TEMPLATE
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.evaluation.sts import evaluate_sts
from lightning_sentemb.methods import PromptBERT, SimCSE
from lightning_sentemb.methods.building import build_method

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


def whole_text(tokenizer: PreTrainedTokenizerFast, sentence: str) -> tuple[list[int], list[int]]:
    """The echo prompt of `sentence` as the tokenizer makes it of the whole text, and the positions of the
    tokens holding any character of its second copy."""
    text = ECHO_TEMPLATE.replace("[X]", sentence)
    encoded = tokenizer(text, return_offsets_mapping=True)
    start = text.rindex(sentence)
    second = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < start + len(sentence) and b > start]
    return encoded["input_ids"], second


@pytest.mark.parametrize("backbone", ["tiny_opt", "echo_decoder"])
def test_echo_rows_are_the_whole_text_tokenized(backbone: str, request: pytest.FixtureRequest) -> None:
    """Byte-level BPE with GPT-2's word-splitting regex (tiny_opt, `</s>` before each text) and one merging
    across spaces and punctuation (`merging_bpe`): each row is the tokenization of the whole prompt, where
    pieces tokenized apart would put a lone-space token before each copy; the echo span covers the second
    copy's tokens; a sentence cut for `max_length` is cut as before (each copy half of what the template
    leaves) and the row is the whole text of the cut sentence."""
    method = build_method(SimCSE, request.getfixturevalue(backbone), template="echo", mlp="none").eval()
    assert method.hparams.pooler == "echo_mean"
    tokenizer, format = method.tokenizer, method.encoder.format
    ids = format.sentence_ids(WORDS)
    features = format.build(ids, None)
    for row, sentence in enumerate(WORDS):
        expected, second = whole_text(tokenizer, sentence)
        assert features["input_ids"][row, : len(expected)].tolist() == expected
        assert features["attention_mask"][row].sum() == len(expected)
        assert features["echo_mask"][row].nonzero().squeeze(1).tolist() == second
        if backbone == "tiny_opt":  # the span is the sentence (its first word with the space before it if one token)
            assert tokenizer.decode(expected[second[0]:second[-1] + 1]) in (sentence, " " + sentence)
    pieces = ECHO_TEMPLATE.split("[X]")
    apart = tokenizer(pieces[0])["input_ids"] + ids[2] + tokenizer(pieces[1], add_special_tokens=False)["input_ids"]
    assert apart + ids[2] != whole_text(tokenizer, WORDS[2])[0]  # the test can fail: pieces tokenized apart differ
    long_sentence = format.sentence_ids([" ".join(WORDS * 2)])
    limit = format.template_length + 11
    cut, kept = format.build(long_sentence, limit), 5
    assert cut["input_ids"].shape[1] <= limit and len(long_sentence[0]) > kept
    text = tokenizer.decode(long_sentence[0][:kept])
    assert cut["input_ids"][0].tolist() == whole_text(tokenizer, text)[0][: cut["input_ids"].shape[1]]
    hidden = method.encoder.run_backbone(features).last_hidden_state
    with torch.no_grad():
        mean = method.encoder(features)
        method.encoder.pooler = "echo_last"
        last = method.encoder(features)
    for row in range(len(ids)):
        span = features["echo_mask"][row].bool()
        torch.testing.assert_close(mean[row], hidden[row, span].mean(0).detach())
        torch.testing.assert_close(last[row], hidden[row, span.nonzero()[-1, 0]].detach())


def test_echo_zero_shot_through_sentemb_evaluate(tiny_opt: str, sts_fixture: Path, tmp_path: Path) -> None:
    """The scores `sentemb evaluate --template echo` writes equal those of the STS scorer on a hand-built
    echo encoding: each sentence alone through the plain `AutoModel`, its second copy's states averaged."""
    output = tmp_path / "scores.json"
    main(["evaluate", "--model", tiny_opt, "--template", "echo", "--pooler", "echo_mean", "--tasks", "sts",
          "--data-dir", str(sts_fixture), "--output", str(output), "--precision", "32"])
    scores = json.loads(output.read_text())["sts"]
    tokenizer, model = AutoTokenizer.from_pretrained(tiny_opt), AutoModel.from_pretrained(tiny_opt).eval()

    def encode(sentences: list[str]) -> torch.Tensor:
        vectors = []
        for sentence in sentences:
            ids, second = whole_text(tokenizer, sentence)
            with torch.no_grad():
                hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            vectors.append(hidden[second].mean(0))
        return torch.stack(vectors)

    tasks = [load_sts_task(name, sts_fixture) for name in scores if name != "avg"]
    assert len(tasks) == 7
    expected = evaluate_sts(encode, tasks)
    assert scores.keys() == expected.keys() and len({round(v, 6) for v in scores.values()}) > 2
    for name, value in expected.items():
        assert scores[name] == pytest.approx(value, abs=1e-6), name


def test_echo_training_packed_equals_padded(tiny_qwen2: str) -> None:
    """Unsupervised SimCSE and supervised NLI (PromptEOL's recipe) with the echo template and pooler: the
    padding-free forward's loss and gradients equal the padded one's."""
    torch.manual_seed(0)
    packed = build_method(SimCSE, tiny_qwen2, template="echo", pooler="echo_last", mlp="none", hard_negative_weight=0.0)
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
        build_method(SimCSE, tiny_qwen2, pooler="echo_mean")
    with pytest.raises(SentEmbUserError, match="second copy"):
        build_method(SimCSE, tiny_qwen2, template="echo", pooler="last")
    with pytest.raises(SentEmbUserError, match="exactly twice"):
        build_method(SimCSE, tiny_qwen2, template="Rewrite: [X]")
    with pytest.raises(SentEmbUserError, match="its own input format"):
        build_method(PromptBERT, tiny_qwen2, template="echo")
